"""Megatron checkpoints (ckpttool/frameworks/megatron/): ``torch_dist`` directories and legacy
``mp_rank`` shards, against what torch's own ``dcp_to_torch_save`` gathers and against each
other (the fixtures hold one model saved both ways: tests/fixtures/frameworks/write_megatron.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli.app import cli
from ckpttool.errors import CkptError
from ckpttool.frameworks.megatron.legacy import split_dim
from ckpttool.io.values import read_array
from ckpttool.model.records import TensorRecord
from tests.test_remote import _upload_tree, bucket, s3_endpoint  # noqa: F401 (fixtures)

MEGATRON = Path(__file__).parent / "fixtures/frameworks/megatron"
DIST = {"tp2": "iter_0000010", "pp2": "iter_0000020", "glu_tp2": "iter_0000030"}
#: megatron-core's sharded_state_dict_keys_map of the local layer spec: the names torch_dist
#: stores the layer norms under (Transformer Engine's fused names).
TE_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def values(ckpt, section: str = "model") -> dict[str, np.ndarray]:
    return {
        key: read_array(ckpt, record)
        for key, record in ckpt.root[section].items()
        if isinstance(record, TensorRecord)
    }


@pytest.mark.parametrize("case", sorted(DIST))
def test_torch_dist_layers_are_the_stacked_rows_torch_gathers(case, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(MEGATRON / case / DIST[case], whole)
    gathered = torch.load(whole, weights_only=False)
    with open_checkpoint(MEGATRON / case) as ckpt:
        assert ckpt.details["layout"] == "megatron_torch_dist"
        model = values(ckpt)
    expected: dict[str, np.ndarray] = {}
    for key, tensor in gathered.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
            for layer in range(tensor.shape[0]):
                name = key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
                expected[name] = tensor[layer].numpy()
        else:
            expected[key] = tensor.numpy()
    assert sorted(model) == sorted(expected)
    for key, array in expected.items():
        assert model[key].tobytes() == array.tobytes(), key


@pytest.mark.parametrize("case", ["tp2", "pp2", "glu_tp2"])
def test_legacy_shards_merged_equal_the_same_model_saved_torch_dist(case):
    """The legacy shards (tensor-parallel pieces, pipeline stages numbered from 0) merged by the
    column/row rules equal the layers torch_dist stores for the same model (glu_tp2: each
    rank's fc1 gate and up halves placed as megatron-core's own GLU sharding places them)."""
    with open_checkpoint(MEGATRON / f"legacy_{case}") as ckpt:
        assert ckpt.details["layout"] == "megatron_legacy"
        merged = values(ckpt)
        assert ckpt.root["iteration"] == int(DIST[case][5:])
    with open_checkpoint(MEGATRON / case) as ckpt:
        dist = values(ckpt)
    renamed = {}
    for key, array in merged.items():
        for legacy, stored in TE_NAMES.items():
            key = key.replace(legacy, stored)
        renamed[key] = array
    assert sorted(renamed) == sorted(dist)
    for key, array in dist.items():
        assert renamed[key].shape == array.shape, key
        assert renamed[key].tobytes() == array.tobytes(), key


def test_show_gives_iteration_parallel_sizes_and_stacked_tensors():
    result = CliRunner().invoke(cli, ["show", str(MEGATRON / "tp2")])
    assert result.exit_code == 0, result.output
    assert "iteration:  10 (from common.pt)" in result.output
    assert "tracker:    latest_checkpointed_iteration.txt names iter_0000010" in result.output
    assert "tensor_model_parallel_size=2, pipeline_model_parallel_size=1" in result.output
    assert (
        "stacked:    decoder.layers.mlp.linear_fc1.weight [2, 32, 8] -> "
        "decoder.layers.N.mlp.linear_fc1.weight (N = 0..1)"
    ) in result.output
    assert "model.decoder.layers.1.mlp.linear_fc1.weight" in result.output


def test_show_legacy_names_the_merge_and_the_padded_vocabulary():
    result = CliRunner().invoke(cli, ["show", str(MEGATRON / "legacy_pp2")])
    assert result.exit_code == 0, result.output
    assert "2 layers renumbered across 2 pipeline stages" in result.output
    assert "vocabulary: 32 embedding rows (args.padded_vocab_size 32)" in result.output
    assert "model.decoder.layers.1.mlp.linear_fc2.weight" in result.output


@pytest.mark.parametrize("case", ["tp2", "legacy_tp2"])
def test_convert_writes_per_layer_names(case, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(MEGATRON / case), str(out)])
    assert result.exit_code == 0, result.output
    written = load_file(out)
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in written
    assert written["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (24, 8)
    assert not any(k.startswith("decoder.layers.self_attention") for k in written)


@pytest.mark.parametrize("case", ["tp2", "pp2", "legacy_tp2", "legacy_pp2"])
def test_verify_passes_the_saves(case):
    result = CliRunner().invoke(cli, ["verify", str(MEGATRON / case)])
    assert result.exit_code == 0, result.output


def test_verify_reports_a_missing_tensor_rank(tmp_path):
    copy = tmp_path / "legacy"
    shutil.copytree(MEGATRON / "legacy_tp2", copy)
    shutil.rmtree(copy / "iter_0000010/mp_rank_01")
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1, result.output
    assert "mp_rank_01/model_optim_rng.pt is missing" in result.output
    with pytest.raises(CkptError, match=r"mp_rank_01/model_optim_rng\.pt is missing"):
        open_checkpoint(copy)


def test_verify_reports_a_replicated_copy_that_differs(tmp_path):
    copy = tmp_path / "legacy"
    shutil.copytree(MEGATRON / "legacy_tp2", copy)
    shard = copy / "iter_0000010/mp_rank_01/model_optim_rng.pt"
    state = torch.load(shard, weights_only=False)
    state["model"]["decoder.final_layernorm.weight"] += 1
    torch.save(state, shard)
    result = CliRunner().invoke(cli, ["verify", str(copy)])
    assert result.exit_code == 1, result.output
    assert "decoder.final_layernorm.weight: whole on each tensor rank, but" in result.output


def test_torch_dist_without_common_pt_is_refused(tmp_path):
    copy = tmp_path / "dist"
    shutil.copytree(MEGATRON / "tp2/iter_0000010", copy)
    (copy / "common.pt").unlink()
    with pytest.raises(CkptError, match=r"no common\.pt"):
        open_checkpoint(copy)


def test_another_sharded_backend_is_refused(tmp_path):
    copy = tmp_path / "dist"
    shutil.copytree(MEGATRON / "tp2/iter_0000010", copy)
    (copy / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CkptError, match="'zarr' checkpoint; ckpttool reads the torch_dist"):
        open_checkpoint(copy)


@pytest.mark.parametrize(("text", "folder"), [("release\n", "release"), ("10", "iter_0000010")])
def test_tracker_names_the_folder_read(tmp_path, text, folder):
    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "tp2/iter_0000010", save / folder)
    (save / "latest_checkpointed_iteration.txt").write_text(text)
    with open_checkpoint(save) as ckpt:
        assert ckpt.details["directory"].endswith(folder)


def test_a_tracker_naming_no_folder_is_an_error(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    with pytest.raises(CkptError, match=r"names iter_0000030, which is not in"):
        open_checkpoint(tmp_path)


def test_diff_of_two_saves_compares_layer_by_layer():
    result = CliRunner().invoke(cli, ["diff", str(MEGATRON / "tp2"), str(MEGATRON / "pp2")])
    assert result.exit_code == 1, result.output
    assert "iteration: 10 -> 20" in result.output
    assert "model.decoder.layers.1.self_attention.linear_qkv.weight   differ" in result.output


@pytest.mark.parametrize(
    ("key", "glu", "expected"),
    [
        ("decoder.layers.0.self_attention.linear_qkv.weight", False, (0, False)),
        ("decoder.layers.0.mlp.linear_fc1.weight", True, (0, True)),
        ("decoder.layers.0.mlp.linear_fc2.weight", False, (1, False)),
        ("decoder.layers.0.mlp.linear_fc2.bias", False, (None, False)),
        ("language_model.encoder.layers.0.self_attention.dense.weight", False, (1, False)),
        ("language_model.encoder.layers.0.mlp.dense_h_to_4h.bias", False, (0, False)),
        ("language_model.embedding.word_embeddings.weight", False, (0, False)),
        ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", False, (None, False)),
        ("decoder.final_layernorm.weight", False, (None, False)),
    ],
)
def test_split_dimension_by_parameter_kind(key, glu, expected):
    assert split_dim(key, glu) == expected


@pytest.mark.slow  # megatron-core under torchrun, 2 processes: a minute or two
def test_megatron_core_writes_what_is_read(tmp_path):
    """The writer run afresh (megatron-core on CPU, gloo): its torch_dist saves read with the
    committed fixtures' names and shapes, and its legacy shards merge to its torch_dist layers
    (the same run's bytes: nothing compared across machines)."""
    import sys

    from tests.fixtures.frameworks.generate import CASE_BY_NAME, write_case

    write_case(CASE_BY_NAME["megatron"], tmp_path, sys.executable)
    fresh = tmp_path / "megatron"
    for case in DIST:
        with open_checkpoint(fresh / case) as ckpt, open_checkpoint(MEGATRON / case) as committed:
            shapes = {k: r.shape for k, r in ckpt.root["model"].items()}
            assert shapes == {k: r.shape for k, r in committed.root["model"].items()}
            dist = values(ckpt)
        with open_checkpoint(fresh / f"legacy_{case}") as ckpt:
            merged = values(ckpt)
        for key, array in merged.items():
            for legacy, stored in TE_NAMES.items():
                key = key.replace(legacy, stored)
            assert dist[key].tobytes() == array.tobytes(), key


@pytest.mark.parametrize("case", ["tp2", "tp2/iter_0000010", "legacy_pp2"])
def test_rescale_step_refuses_saying_megatron_needs_none(case):
    result = CliRunner().invoke(
        cli, ["rescale-step", str(MEGATRON / case), "--world-size", "4", "--dry-run"]
    )
    assert result.exit_code == 2, result.output
    assert "Megatron resumes at any data-parallel size without rescaling" in result.output


def _chunked(key: str, shape: tuple[int, ...]) -> TensorRecord:
    from ckpttool.model.records import ChunkedStorageRecord, ChunkRecord

    numel = int(np.prod(shape))
    chunk = ChunkRecord("__0_0.distcp", 0, 0, tuple(0 for _ in shape), shape)
    storage = ChunkedStorageRecord(
        key=key, dtype="float32", numel=numel, location="cpu", record="dcp",
        data_size=4 * numel, chunks=(chunk,), shape=shape,
    )  # fmt: skip
    stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    return TensorRecord(key, "float32", shape, stride, 0, storage)


def test_model_space_optimizer_state_is_unstacked_and_flat_buckets_are_named():
    """megatron-core's optimizer on CPU needs CUDA (FP32Optimizer's scale tensor), so its keys
    are built here as distrib_optimizer.py names them: ``optimizer.state.<state>.<param key>``
    (model space: per parameter, stacked like the parameter) and
    ``optimizer.distributed.dp_group_idx_0...`` (flat buckets: left as stored)."""
    from ckpttool.frameworks.megatron.dist import _unstack

    tree = {
        "decoder.layers.mlp.linear_fc1.weight": _chunked("w", (2, 4, 3)),
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight": _chunked("m", (2, 4, 3)),
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.param": _chunked("flat", (24,)),
    }
    notes: list[str] = []
    root, stacked = _unstack(tree, {"args": {"num_layers": 2}, "iteration": 3}, notes)
    assert list(root["model"]) == [
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight",
    ]  # fmt: skip
    assert list(root["optimizer"]) == [
        "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight",
        "optimizer.state.exp_avg.decoder.layers.1.mlp.linear_fc1.weight",
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.param",
    ]
    layer1 = root["optimizer"]["optimizer.state.exp_avg.decoder.layers.1.mlp.linear_fc1.weight"]
    assert layer1.shape == (4, 3) and layer1.storage.base == 48
    assert [s["key"] for s in stacked] == [
        "decoder.layers.mlp.linear_fc1.weight",
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
    ]
    assert notes and notes[0].startswith("optimizer.distributed.dp_group_idx_0: the distributed")


def test_a_torch_dist_folder_in_s3_is_megatron_s(bucket, tmp_path):  # noqa: F811 (fixtures)
    """Over a URL the folder is asked of Megatron before the DCP reader opens it alone."""
    url = _upload_tree(MEGATRON / "tp2/iter_0000010", "megatron/iter_0000010")
    with open_checkpoint(url) as remote, open_checkpoint(MEGATRON / "tp2/iter_0000010") as local:
        assert remote.details["layout"] == "megatron_torch_dist"
        assert remote.root["iteration"] == 10
        assert values(remote).keys() == values(local).keys()
        for key, array in values(local).items():
            assert values(remote)[key].tobytes() == array.tobytes(), key


@pytest.mark.parametrize("case", ["tp2", "legacy_tp2"])
def test_scan_walks_every_file_of_a_save(case):
    result = CliRunner().invoke(cli, ["scan", str(MEGATRON / case / DIST["tp2"])])
    assert result.exit_code == 0, result.output
    assert "0 findings" in result.output


def test_a_legacy_release_folder(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "legacy_pp2/iter_0000020", save / "release")
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    with open_checkpoint(save) as ckpt:
        assert ckpt.details["layout"] == "megatron_legacy"
        assert "decoder.layers.1.mlp.linear_fc2.weight" in ckpt.root["model"]


def test_scan_reads_common_pt_beside_the_dcp_files(tmp_path):
    """common.pt is a pickle of its own, outside the DCP items: scan walks it too (a global
    that would run in it is found, whether the folder or its save directory is named)."""
    save = tmp_path / "save"
    shutil.copytree(MEGATRON / "tp2", save)

    class Run:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"iteration": 10, "args": Run()}, save / "iter_0000010/common.pt")
    for target in (save, save / "iter_0000010"):
        result = CliRunner().invoke(cli, ["scan", str(target)])
        assert result.exit_code == 1, result.output
        assert "common.pt" in result.output and "system" in result.output
