"""The committed fixtures: reproducible, small, and holding what tests/fixtures/generate.py says."""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import platform
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.fixtures import generate
from tests.fixtures.generate import (
    FIXTURE_FILES,
    FIXTURES_DIR,
    MICRO,
    NOT_TORCH_PICKLES,
    ROUNDING_FIXTURES,
    TINY,
    TINY_MOE,
    WEIGHTS_ONLY_UNREADABLE,
    TrainConfig,
    tiny_model,
    write_legacy_checkpoint,
    write_zip_checkpoint,
)
from tests.support.minimind import MiniMindForCausalLM, causal_lm_loss, minimind_config

TORCH_PICKLES = [name for name in FIXTURE_FILES if name not in NOT_TORCH_PICKLES]
TIED = ("model.embed_tokens.weight", "lm_head.weight")
REPO = FIXTURES_DIR.parents[1]


def load(name: str, *, weights_only: bool = True) -> Any:
    return torch.load(FIXTURES_DIR / name, map_location="cpu", weights_only=weights_only)


def zip_names(name: str) -> list[str]:
    with zipfile.ZipFile(FIXTURES_DIR / name) as archive:
        return archive.namelist()


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def expected_keys(config: Any) -> list[str]:
    with torch.device("meta"):
        return list(MiniMindForCausalLM(config).state_dict())


@pytest.mark.slow  # every fixture rewritten, the DCP ones by two spawned ranks
def test_regenerating_gives_the_committed_fixtures() -> None:
    assert generate.check() == []


def _regenerate(out: Path, **env: str) -> None:
    command = [sys.executable, "-m", "tests.fixtures.generate", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, **env}, cwd=REPO)


@pytest.mark.slow  # the same, in a subprocess without SIMD
def test_regenerating_with_another_vector_unit_passes_the_check(tmp_path: Path) -> None:
    """torch's kernels without SIMD (``ATEN_CPU_CAPABILITY=default``) round AdamW differently
    from AVX2/AVX-512: the check must accept that, and only in the trained fixtures."""
    _regenerate(tmp_path, ATEN_CPU_CAPABILITY="default")
    names = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    byte_different = {
        name
        for name in names
        if (FIXTURES_DIR / name).read_bytes() != (tmp_path / name).read_bytes()
    }
    assert byte_different <= ROUNDING_FIXTURES, byte_different - ROUNDING_FIXTURES
    if platform.machine().lower() in ("x86_64", "amd64"):  # elsewhere "default" may be native
        assert byte_different, "expected the non-SIMD kernels to round some value differently"
    problems = {
        name: generate.compare_fixture(
            name, (FIXTURES_DIR / name).read_bytes(), (tmp_path / name).read_bytes(), FIXTURES_DIR
        )
        for name in byte_different
    }
    assert {name: p for name, p in problems.items() if p} == {}


def _moved(data: bytes, span: tuple[int, int, str], ulps: float) -> bytes:
    """``data`` with the largest-magnitude float of ``span`` moved by ``ulps`` of its ulp."""
    from tests.fixtures.compare import _ulp

    offset, length, dtype = span
    values = np.frombuffer(data[offset : offset + length], dtype=dtype).copy()
    index = int(np.abs(values.astype(np.float64)).argmax())
    values[index] += np.array(ulps * _ulp(float(abs(values[index])), dtype), dtype=dtype)
    return data[:offset] + values.tobytes() + data[offset + length :]


def _resaved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


LIGHTNING = "lightning/epoch=1-step=40.ckpt"


def test_compare_controls_resaving_reproduces_the_bytes() -> None:
    # The mutation tests below re-save edited objects; unedited, a re-save is byte-identical.
    assert _resaved(load(LIGHTNING)) == (FIXTURES_DIR / LIGHTNING).read_bytes()


@pytest.mark.parametrize("ulps", [0.5, 1, 4, 16])
def test_compare_accepts_kernel_rounding_in_a_trained_fixture(ulps: float) -> None:
    from tests.fixtures.compare import float_spans

    committed = (FIXTURES_DIR / "safetensors/model.safetensors").read_bytes()
    fresh = _moved(committed, float_spans(committed, "model.safetensors")[-1], ulps)
    assert fresh != committed
    assert (
        generate.compare_fixture("safetensors/model.safetensors", committed, fresh, FIXTURES_DIR)
        is None
    )


@pytest.mark.parametrize("ulps", [64, 10_000])
def test_compare_refuses_more_than_kernel_rounding(ulps: float) -> None:
    from tests.fixtures.compare import float_spans

    committed = (FIXTURES_DIR / "safetensors/model.safetensors").read_bytes()
    fresh = _moved(committed, float_spans(committed, "model.safetensors")[-1], ulps)
    problem = generate.compare_fixture(
        "safetensors/model.safetensors", committed, fresh, FIXTURES_DIR
    )
    assert problem is not None and "more than kernel rounding" in problem


def test_compare_refuses_any_change_in_a_byte_exact_fixture() -> None:
    from tests.fixtures.compare import float_spans

    name = "legacy/state_dict.pth"
    assert name not in ROUNDING_FIXTURES
    committed = (FIXTURES_DIR / name).read_bytes()
    fresh = _moved(committed, float_spans(committed, name)[0], 1)
    assert generate.compare_fixture(name, committed, fresh, FIXTURES_DIR) is not None


def _edit_key(ckpt: dict[str, Any]) -> None:
    ckpt["state_dict"]["model.lm_heax.weight"] = ckpt["state_dict"].pop("model.lm_head.weight")


def _edit_dtype(ckpt: dict[str, Any]) -> None:  # same bytes, another dtype
    ckpt["state_dict"]["model.model.norm.weight"] = ckpt["state_dict"][
        "model.model.norm.weight"
    ].view(torch.int32)


def _edit_shape(ckpt: dict[str, Any]) -> None:
    ckpt["state_dict"]["model.lm_head.weight"] = ckpt["state_dict"]["model.lm_head.weight"].reshape(
        -1
    )


def _edit_counter(ckpt: dict[str, Any]) -> None:
    ckpt["global_step"] = 41


@pytest.mark.parametrize("edit", [_edit_key, _edit_dtype, _edit_shape, _edit_counter])
def test_compare_refuses_a_structural_change_in_a_trained_fixture(edit: Any) -> None:
    assert LIGHTNING in ROUNDING_FIXTURES
    ckpt = load(LIGHTNING)
    edit(ckpt)
    committed = (FIXTURES_DIR / LIGHTNING).read_bytes()
    assert generate.compare_fixture(LIGHTNING, committed, _resaved(ckpt), FIXTURES_DIR) is not None


def test_compare_refuses_a_changed_integer_storage_in_a_trained_fixture() -> None:
    ckpt = load(LIGHTNING)
    ckpt["step_tensor"] = torch.tensor([7], dtype=torch.int64)
    before = _resaved(ckpt)
    ckpt["step_tensor"][0] = 8  # same size, same structure: only the int64 bytes differ
    after = _resaved(ckpt)
    assert len(before) == len(after) and before != after
    problem = generate.compare_fixture(LIGHTNING, before, after, FIXTURES_DIR)
    assert problem is not None and "outside floating-point values" in problem


def test_compare_refuses_a_torn_zip_member() -> None:
    committed = bytearray((FIXTURES_DIR / LIGHTNING).read_bytes())
    from tests.fixtures.compare import float_spans

    offset, _, _ = float_spans(bytes(committed), LIGHTNING)[0]
    committed[offset] ^= 0x01  # a flipped bit whose CRC-32 no longer matches
    problem = generate.compare_fixture(
        LIGHTNING, (FIXTURES_DIR / LIGHTNING).read_bytes(), bytes(committed), FIXTURES_DIR
    )
    assert problem is not None


def test_committed_files_are_exactly_the_generated_ones() -> None:
    assert generate.committed_files() == set(FIXTURE_FILES)


def test_fixtures_total_under_2_mb() -> None:
    total = sum((FIXTURES_DIR / name).stat().st_size for name in FIXTURE_FILES)
    assert total < 2 * 1024 * 1024, total


@pytest.mark.parametrize("name", TORCH_PICKLES)
def test_every_torch_file_loads_unsafely(name: str) -> None:
    assert load(name, weights_only=False) is not None


@pytest.mark.parametrize("name", TORCH_PICKLES)
def test_weights_only_readability_is_as_documented(name: str) -> None:
    if name in WEIGHTS_ONLY_UNREADABLE:
        with pytest.raises(pickle.UnpicklingError):
            load(name)
    else:
        assert load(name) is not None


def test_zip_writer_matches_torch_save_byte_for_byte(tmp_path: Path) -> None:
    state = tiny_model(MICRO, seed=1).state_dict()
    obj = {"model": state, "raw": torch.ones(3).untyped_storage(), "view": state[TIED[1]][2:, 1]}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save(obj, tmp_path / "a/same.pth")
    write_zip_checkpoint(obj, tmp_path / "b/same.pth")
    assert (tmp_path / "a/same.pth").read_bytes() == (tmp_path / "b/same.pth").read_bytes()


def test_legacy_writer_matches_torch_save_byte_for_byte() -> None:
    obj = {"model": tiny_model(MICRO, seed=2).state_dict(), "half": torch.ones(4).half()[1:]}
    by_torch, by_us = io.BytesIO(), io.BytesIO()
    torch.save(obj, by_torch, _use_new_zipfile_serialization=False)
    write_legacy_checkpoint(obj, by_us, lambda index, storage: str(storage._cdata))
    assert by_torch.getvalue() == by_us.getvalue()


def test_minimind_weights_are_a_plain_fp16_dict_with_untied_copies() -> None:
    weights = load("minimind/pretrain_32.pth")
    assert type(weights) is dict
    assert list(weights) == expected_keys(TINY)
    assert {t.dtype for t in weights.values()} == {torch.float16}
    embed, head = (weights[k] for k in TIED)
    assert torch.equal(embed, head) and not shares_storage(embed, head)
    assert zip_names("minimind/pretrain_32.pth")[0] == "pretrain_32.pth/data.pkl"


def test_minimind_resume_is_what_lm_checkpoint_writes() -> None:
    resume = load("minimind/pretrain_32_resume.pth")
    assert list(resume) == [
        "model", "optimizer", "epoch", "step", "world_size", "wandb_id", "scaler",
    ]  # fmt: skip
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (1, 1200, 8)
    assert resume["wandb_id"] == "run-abc123"
    assert {t.dtype for t in resume["model"].values()} == {torch.float16}
    assert torch.equal(resume["model"]["lm_head.weight"], load("minimind/pretrain_32.pth")[TIED[1]])
    state = resume["optimizer"]["state"]
    unique_params = len(expected_keys(TINY)) - 1  # the tied weight is one parameter
    assert sorted(state) == list(range(unique_params))
    assert resume["optimizer"]["param_groups"][0]["params"] == list(range(unique_params))
    for entry in state.values():
        assert list(entry) == ["step", "exp_avg", "exp_avg_sq"]
        assert entry["step"].item() == 3.0 and entry["exp_avg"].dtype == torch.float32
    assert resume["scaler"] == {
        "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 2000, "_growth_tracker": 3,
    }  # fmt: skip


def test_minimind_resume_restores_into_a_fresh_run() -> None:
    resume = load("minimind/pretrain_32_resume.pth")
    model = MiniMindForCausalLM(TINY)
    model.load_state_dict(resume["model"])
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(resume["optimizer"])
    loss = causal_lm_loss(model, torch.arange(16).reshape(2, 8) % TINY.vocab_size)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)


def test_minimind_moe_files() -> None:
    weights = load("minimind/pretrain_32_moe.pth")
    assert list(weights) == expected_keys(TINY_MOE)
    assert "model.layers.1.mlp.experts.1.up_proj.weight" in weights
    assert weights["model.layers.0.mlp.gate.weight"].shape == (2, 32)
    resume = load("minimind/pretrain_32_moe_resume.pth")
    assert resume["world_size"] == 2 and resume["wandb_id"] is None and resume["scaler"] == {}
    assert zip_names("minimind/pretrain_32_moe_resume.pth")[0].startswith("pretrain_32_moe_resume.")


def test_ckpttool_files() -> None:
    weights = load("ckpttool/pretrain_32.pth")
    assert list(weights) == expected_keys(TINY)
    assert {t.dtype for t in weights.values()} == {torch.float16}
    resume = load("ckpttool/pretrain_32_resume.pth")
    assert list(resume)[:6] == ["model", "optimizer", "epoch", "step", "world_size", "wandb_id"]
    assert {"scaler", "scheduler", "rng", "config"} <= set(resume)
    assert (resume["epoch"], resume["step"]) == (1, 40)
    assert resume["model"][TIED[0]].dtype == torch.float32
    assert shares_storage(*(resume["model"][k] for k in TIED))
    assert resume["scheduler"]["lr_lambdas"] == [None]
    assert resume["config"] == TINY.as_dict()


def test_legacy_state_dict() -> None:
    raw = (FIXTURES_DIR / "legacy/state_dict.pth").read_bytes()
    assert not zipfile.is_zipfile(io.BytesIO(raw))
    assert pickle.loads(raw) == torch.serialization.MAGIC_NUMBER  # the stream's first pickle
    state = load("legacy/state_dict.pth")
    assert isinstance(state, collections.OrderedDict) and hasattr(state, "_metadata")
    assert shares_storage(*(state[k] for k in TIED))
    assert torch.equal(state["lm_head.weight"], tiny_model(MICRO, seed=400).lm_head.weight)


def test_legacy_resume_with_id_keyed_optimizer_state() -> None:
    optimizer = load("legacy/resume_bigkeys.pth")["optimizer"]
    keys = list(optimizer["state"])
    assert keys == optimizer["param_groups"][0]["params"]
    assert all(key > 2**40 for key in keys)
    assert all(type(entry["step"]) is int for entry in optimizer["state"].values())


def test_safetensors_drops_the_tied_alias_and_matches_the_minimind_weights() -> None:
    from safetensors import safe_open

    with safe_open(str(FIXTURES_DIR / "safetensors/model.safetensors"), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    assert metadata == {
        "format": "pt", "source": "ckpttool test fixtures", TIED[0]: TIED[1],
    }  # fmt: skip
    assert set(tensors) == set(expected_keys(TINY)) - {TIED[0]}
    fp16 = load("minimind/pretrain_32.pth")
    assert all(torch.equal(tensor.half(), fp16[key]) for key, tensor in tensors.items())


@pytest.mark.parametrize(
    ("name", "prefix"),
    [("wrapped/ddp.pth", "module."), ("wrapped/compiled.pth", "_orig_mod."),
     ("wrapped/ddp_compiled.pth", "module._orig_mod.")],
)  # fmt: skip
def test_wrapped_prefixes(name: str, prefix: str) -> None:
    state = load(name)
    assert [key.removeprefix(prefix) for key in state] == expected_keys(MICRO)
    assert shares_storage(*(state[prefix + k] for k in TIED))


def test_lightning_checkpoint() -> None:
    ckpt = load("lightning/epoch=1-step=40.ckpt")
    assert list(ckpt) == [
        "epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
        "optimizer_states", "lr_schedulers", "hparams_name", "hyper_parameters",
    ]  # fmt: skip
    assert ckpt["pytorch-lightning_version"] == "2.4.0" and ckpt["global_step"] == 40
    assert [k.removeprefix("model.") for k in ckpt["state_dict"]] == expected_keys(MICRO)
    assert len(ckpt["optimizer_states"]) == 1 and "last_epoch" in ckpt["lr_schedulers"][0]
    assert zip_names("lightning/epoch=1-step=40.ckpt")[0] == "archive/data.pkl"


def test_cuda_storages_need_a_map_location() -> None:
    with zipfile.ZipFile(FIXTURES_DIR / "special/cuda_storages.pth") as archive:
        pickled = archive.read("cuda_storages/data.pkl")
    assert b"cuda:0" in pickled and b"cuda:1" in pickled
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(FIXTURES_DIR / "special/cuda_storages.pth", weights_only=True)
    ckpt = load("special/cuda_storages.pth")
    assert ckpt["model"]["lm_head.weight"].device.type == "cpu"
    assert torch.equal(ckpt["ema"]["model.norm.weight"], ckpt["model"]["model.norm.weight"])


def test_custom_prefix() -> None:
    names = zip_names("special/custom_prefix.pth")
    assert names[0] == "model_600000/data.pkl"
    assert all(name.startswith("model_600000/") for name in names)


def test_nonnumeric_storage_keys() -> None:
    names = zip_names("special/nonnumeric_keys.pth")
    data = sorted(name.split("/data/")[1] for name in names if "/data/" in name)
    assert data == sorted(generate.NONNUMERIC_KEYS)
    ckpt = load("special/nonnumeric_keys.pth")
    assert shares_storage(ckpt["embed_row"], ckpt["embed"])
    assert torch.equal(ckpt["embed_row"], ckpt["embed"][3])


def test_numpy_and_python_rng_states() -> None:
    ckpt = load("special/numpy_rng.pth", weights_only=False)
    name, key, *_ = ckpt["numpy"]
    assert name == "MT19937" and key.dtype == np.uint32 and key.shape == (624,)
    assert ckpt["python"][0] == 3 and len(ckpt["python"][1]) == 625
    assert ckpt["torch"].dtype == torch.uint8
    assert isinstance(ckpt["best_loss"], np.float64) and ckpt["loss_history"].dtype == np.float32


def test_namespace_and_user_config_class() -> None:
    ckpt = load("special/namespace_config.pth", weights_only=False)
    assert isinstance(ckpt["args"], argparse.Namespace) and ckpt["args"].batch_size == 32
    assert ckpt["config"] == TrainConfig()
    pickled = zipfile.ZipFile(FIXTURES_DIR / "special/namespace_config.pth").read(
        "namespace_config/data.pkl"
    )
    assert b"tests.fixtures.generate\nTrainConfig" in pickled


def test_views_share_their_base_storage() -> None:
    ckpt = load("special/views.pth")
    base = ckpt["base"]
    for name in ("transposed", "rows", "column"):
        assert shares_storage(ckpt[name], base)
    assert ckpt["transposed"].stride() == (1, 6) and not ckpt["transposed"].is_contiguous()
    assert ckpt["rows"].storage_offset() == 12
    assert (ckpt["column"].storage_offset(), ckpt["column"].stride()) == (1, (6,))
    assert torch.equal(ckpt["transposed"], base.t())


@pytest.mark.filterwarnings("ignore:.*TorchScript archive")
def test_torchscript_is_an_archive_not_a_checkpoint() -> None:
    names = zip_names("special/torchscript.pt")
    assert "torchscript/constants.pkl" in names
    assert any(name.startswith("torchscript/code/") for name in names)
    repo_root = str(FIXTURES_DIR.parents[1]).encode()
    assert repo_root not in (FIXTURES_DIR / "special/torchscript.pt").read_bytes()
    with pytest.raises(RuntimeError, match="TorchScript"):
        load("special/torchscript.pt")


def test_nested_generic_structure() -> None:
    ckpt = load("special/nested_generic.pth")
    assert ckpt["tags"] == {1, 2, 3} and ckpt["blob"].startswith(b"\x00\x01")
    assert ckpt["numbers"][2] == 2**70 and ckpt["numbers"][5] == 1 + 2j
    assert ckpt["levels"]["deep"]["deeper"]["deepest"].dtype == torch.bfloat16
    assert ckpt["levels"]["two"][1][1].numel() == 0 and ckpt["scalar"].dim() == 0
    assert isinstance(ckpt["ordered"], collections.OrderedDict)


def test_minimind_config_matches_minimind2_sizes() -> None:
    with torch.device("meta"):
        sizes = {h: sum(p.numel() for p in MiniMindForCausalLM(minimind_config(h)).parameters())
                 for h in (512, 768)}  # fmt: skip
    assert sizes == {512: 25_829_888, 768: 104_030_976}  # MiniMind2-small 26M, MiniMind2 104M
    assert minimind_config(768).intermediate_size == 2048
    assert minimind_config(512).intermediate_size == 1408


def test_tiny_model_is_tied_and_trains() -> None:
    model = MiniMindForCausalLM(TINY_MOE)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loss = causal_lm_loss(model, torch.randint(0, TINY.vocab_size, (2, 8)))
    loss.backward()
    assert (
        torch.isfinite(loss)
        and model.get_parameter("model.layers.0.mlp.gate.weight").grad is not None
    )
