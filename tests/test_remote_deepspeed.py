"""DeepSpeed ZeRO save and tag directories read from a URL (issues 16 and 17 together).

The DeepSpeed-written fixtures are uploaded to moto's S3 server (the fixtures of
tests/test_remote.py); every remote result is compared with the same command run on the local
directory in the same test. Over HTTP, which cannot list, such a directory is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.convert.run import convert
from ckpttool.errors import InputError
from ckpttool.io import remote
from ckpttool.model.records import TensorRecord, walk
from tests import test_remote as shared
from tests.support.helpers import FIXTURES
from tests.support.range_server import RangeServer
from tests.test_remote import _upload_tree, run, show_json

# tests/test_remote.py's fixtures, registered here too: moto's S3 server and its bucket, the
# loopback HTTP range server, and the shortened retries (autouse)
bucket, s3_endpoint, server = shared.bucket, shared.s3_endpoint, shared.server
quick_retries = shared.quick_retries

DEEPSPEED = FIXTURES / "deepspeed"
#: A 2-process ZeRO-2 (bf16: the ``bf16_`` optimizer files) and a 2-process ZeRO-3 case.
CASES = ["stage2_bf16_2proc", "stage3_fp32_2proc"]
#: The fixtures' model: 8 trained parameters of 335 elements (tests/fixtures/deepspeed/README.md).
TRAINED_ELEMENTS = 335


def _checkpoints(case: str) -> Path:
    return DEEPSPEED / case / "checkpoints"


def _verify(target: str | Path) -> tuple[int, dict[str, Any]]:
    result = run("verify", target, "--json")
    found = json.loads(result.stdout)["files"][0]
    found.pop("path")
    return result.exit_code, found


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tag", ["", "global_step2"], ids=["save_dir", "tag_dir"])
def test_show_verify_convert_diff_from_s3_equal_local(
    bucket: str, tmp_path: Path, case: str, tag: str
) -> None:
    # the same last name as the local directory: the output's metadata names its source
    save_dir = _upload_tree(_checkpoints(case), f"ds/{case}/checkpoints")
    url = f"{save_dir}/{tag}" if tag else save_dir
    local = _checkpoints(case) / tag if tag else _checkpoints(case)
    assert show_json(url) == show_json(local)
    assert show_json(url, "--stats") == show_json(local, "--stats")
    verified, expected = _verify(url), _verify(local)
    assert verified == expected and verified[0] == 0
    out, reference = tmp_path / "url.safetensors", tmp_path / "local.safetensors"
    converted = run("convert", url, out)
    assert converted.exit_code == 0, converted.output
    assert "consolidated 8 trained parameters (fp32 master weights)" in converted.stderr
    assert run("convert", local, reference).exit_code == 0
    assert out.read_bytes() == reference.read_bytes()
    assert run("diff", url, local).exit_code == 0
    # the other tag differs (two more steps): diff reads both sides' consolidated weights
    other = _checkpoints(case) / ("global_step4" if tag else "global_step2")
    remote_diff = run("diff", url, other, "--json")
    local_diff = run("diff", local, other, "--json")
    assert remote_diff.exit_code == local_diff.exit_code == 1
    reports = [json.loads(r.stdout) for r in (remote_diff, local_diff)]
    for report in reports:
        report["a"].pop("path")
    assert reports[0] == reports[1]


def _spans(path: Path, wanted: tuple[str, ...]) -> list[tuple[int, int]]:
    """(start, stop) file offsets of the bytes of every tensor named ``wanted`` in ``path``."""
    spans = []
    with open_checkpoint(path) as ckpt:
        for key, value in walk(ckpt.root):
            if isinstance(value, TensorRecord) and key.rsplit(".", 1)[-1] in wanted:
                assert value.storage is not None
                offset, length = ckpt.storage_span(value.storage)
                spans.append((offset, offset + length))
    return spans


@pytest.mark.parametrize("case", CASES)
def test_convert_from_s3_fetches_the_fp32_partitions_never_the_adam_moments(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Every fetched range is recorded (one-byte cache blocks: a fetch is exactly the range the
    reader asked for); none touches an ``exp_avg``/``exp_avg_sq`` storage, the fp32 partitions
    are fetched, and the counters add up to the ranges."""
    monkeypatch.setattr(remote, "BLOCK", 1)
    fetched: list[tuple[str, int, int]] = []
    original = remote.RemoteFile._fetch

    def recording(self: remote.RemoteFile, start: int, stop: int) -> bytes:
        fetched.append((self.name.rsplit("/", 1)[-1], start, stop))
        return original(self, start, stop)

    opened = []
    open_remote = remote.open_remote

    def counting(url: str) -> remote.RemoteFile:
        opened.append(url)
        return open_remote(url)

    monkeypatch.setattr(remote.RemoteFile, "_fetch", recording)
    monkeypatch.setattr(remote, "open_remote", counting)
    url = _upload_tree(_checkpoints(case), f"ranges/{case}")
    remote.reset_totals()
    convert(url, tmp_path / "model.safetensors")
    # the counters: the ranges fetched, and the one byte each opening counts for its size
    assert remote.TOTALS.bytes_fetched == sum(stop - start for _, start, stop in fetched) + len(
        opened
    )
    tag = _checkpoints(case) / "global_step4"
    optim_files = sorted(tag.glob("*_optim_states.pt"))
    assert len(optim_files) == 2
    fp32 = "single_partition_of_fp32_groups" if "stage2" in case else "fp32_flat_groups"
    partition_bytes = 0
    for path in optim_files:
        moments = _spans(path, ("exp_avg", "exp_avg_sq"))
        ranges = [(start, stop) for name, start, stop in fetched if name == path.name]
        assert moments and ranges
        for start, stop in ranges:
            for lo, hi in moments:
                assert stop <= lo or start >= hi, (path.name, (start, stop), (lo, hi))
        fetched_bytes = set().union(*(range(start, stop) for start, stop in ranges))
        partitions = set().union(*(range(lo, hi) for lo, hi in _partition_spans(path, fp32)))
        partition_bytes += len(fetched_bytes & partitions)
        moment_bytes = sum(hi - lo for lo, hi in moments)
        assert len(fetched_bytes) <= path.stat().st_size - moment_bytes
    # every trained element's fp32 master weight fetched once, the partitions' padding not
    assert partition_bytes == TRAINED_ELEMENTS * 4


def _partition_spans(path: Path, key: str) -> list[tuple[int, int]]:
    """File spans of the flat fp32 partitions (the elements of ``key``'s list) in ``path``."""
    spans = []
    with open_checkpoint(path) as ckpt:
        for name, value in walk(ckpt.root):
            if isinstance(value, TensorRecord) and f".{key}." in f".{name}.":
                assert value.storage is not None
                offset, length = ckpt.storage_span(value.storage)
                spans.append((offset, offset + length))
    assert spans
    return spans


def test_a_rank_file_replaced_during_convert_writes_nothing(bucket: str, tmp_path: Path) -> None:
    """Each rank file's size and ETag are asked again before the output is committed."""
    import boto3

    local = _checkpoints(CASES[0])
    url = _upload_tree(local, "replaced")
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    replaced: list[int] = []

    def replace_once(nbytes: int) -> None:
        if not replaced:
            replaced.append(nbytes)
            older = (local / "global_step2" / name).read_bytes()  # same size, other bytes
            boto3.client("s3").put_object(
                Bucket="ckpts", Key=f"replaced/global_step4/{name}", Body=older
            )

    with pytest.raises(InputError, match=f"{name}: the file changed while it was being read"):
        convert(url, tmp_path / "model.safetensors", progress=replace_once)
    assert replaced and list(tmp_path.iterdir()) == []


def test_a_damaged_tag_in_s3_is_reported_as_locally(bucket: str, tmp_path: Path) -> None:
    local = DEEPSPEED / "damaged" / "optim_missing" / "checkpoints"
    url = _upload_tree(local, "damaged/optim_missing")
    verified = _verify(url)
    assert verified == _verify(local) and verified[0] == 1
    result = run("convert", url, tmp_path / "model.safetensors")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {url}/global_step4: the optimizer states record 2")
    assert result.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_a_dangling_latest_in_s3_is_one_line_naming_it(bucket: str) -> None:
    url = _upload_tree(DEEPSPEED / "damaged" / "latest_dangling" / "checkpoints", "dangling")
    result = run("convert", url, "unused.safetensors")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {url}: latest: names tag 'global_step9', which does not exist "
        "(tags here: global_step2, global_step4)\n"
    )


def test_rescale_step_refuses_a_deepspeed_url(bucket: str) -> None:
    url = _upload_tree(_checkpoints(CASES[0]), "rescale")
    remote.reset_totals()
    result = run("rescale-step", url, "--world-size", "1", "-o", "universal")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {url}: rescale-step rewrites a local file (atomically, with a rename); "
        "download the checkpoint first\n"
    )
    assert remote.TOTALS.requests == 0


def test_a_deepspeed_directory_over_http_needs_a_store_that_lists(
    server: RangeServer, tmp_path: Path
) -> None:
    local = _checkpoints(CASES[0])
    for member in sorted(p for p in local.rglob("*") if p.is_file()):
        server.add(f"ds/{member.relative_to(local).as_posix()}", member.read_bytes())
    for target in (server.url("ds") + "/", server.url("ds/global_step4") + "/"):
        for args in (["show", target], ["convert", target, tmp_path / "out.safetensors"]):
            result = run(*args)
            assert result.exit_code == 2, result.output
            assert result.stderr.startswith(f"Error: {target.rstrip('/')}")
            assert "HTTP cannot list a directory" in result.stderr
            assert result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
