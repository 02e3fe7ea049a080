"""Checkpoints behind URLs (issue 17), against real servers on the loopback address.

An HTTP server that honours Range (tests/support/range_server.py; also one that does not, and
one that fails on purpose), the hub's resolve URLs through ``HF_ENDPOINT``, and an S3-compatible
server (moto's server mode) with a bucket these tests fill. Every remote result is compared with
the same command run on the local file in the same test.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.commands.convert.run import convert
from ckpttool.errors import InputError
from ckpttool.io import remote, remote_backends
from tests.support.helpers import FIXTURES
from tests.support.range_server import RangeServer
from tests.support.timeouts import scaled

RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"
SAFETENSORS = FIXTURES / "pairs/base.safetensors"
LEGACY = FIXTURES / "pairs/base_legacy.pth"
FINE = FIXTURES / "pairs/fine_fp32.pth"
BASE = FIXTURES / "pairs/base.pth"


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def server() -> Iterator[RangeServer]:
    started = RangeServer().start()
    yield started
    started.stop()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoff shortened (the attempts' count, not their spacing, is under test). The request
    timeout stays the product's: on the loopback a request is answered at once or hangs, and a
    shorter one would turn a busy machine's slow answer into an unplanned retry."""
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    monkeypatch.setattr(remote_backends, "TIMEOUT", scaled(30.0))


def show_json(target: str | Path, *extra: str) -> dict[str, Any]:
    result = run("show", target, "--json", *extra)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    report.pop("file")
    report.get("details", {}).pop("directory", None)  # a framework directory's own name
    return report


# -- reading what is needed, and only that ----------------------------------------------------


@pytest.mark.parametrize("local", [RESUME, SAFETENSORS, LEGACY], ids=lambda p: p.name)
def test_show_and_stats_over_http_equal_local(server: RangeServer, local: Path) -> None:
    url = server.add(local.name, local.read_bytes())
    assert show_json(url) == show_json(local)
    assert show_json(url, "--stats") == show_json(local, "--stats")


def test_show_fetches_the_directory_and_pickle_only(server: RangeServer) -> None:
    """Every request of a URL's show is for the pickle (at the start of a torch zip) or for the
    end record and directory (the last 64 KiB + 22 bytes, where the end record is searched)."""
    from ckpttool.formats.torch_zip.reader import member_span, open_zip

    data = RESUME.read_bytes()
    url = server.add("resume.pth", data)
    with open(RESUME, "rb") as handle:
        archive = open_zip(handle)
        pkl = next(m for m in archive.infolist() if m.filename.endswith("/data.pkl"))
        pkl_end = sum(member_span(handle, pkl))
    tail_start = len(data) - (65536 + 22)
    result = run("show", url, "--verbose")
    assert result.exit_code == 0, result.output
    line = result.stderr.splitlines()[-1]
    assert line.startswith("remote: ") and f"of {len(data):,}" in line
    assert len(server.requests) <= 4
    for _, wanted in server.requests:
        assert wanted is not None  # every request a ranged one
        first, last = (int(n) for n in wanted.removeprefix("bytes=").split("-"))
        near_pickle = first < pkl_end and last < pkl_end + remote.BLOCK
        near_directory = first >= tail_start - remote.BLOCK
        assert near_pickle or near_directory, wanted


def test_values_read_large_tensors_in_concurrent_parts(
    server: RangeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "SMALL_READ", 256)
    monkeypatch.setattr(remote, "PART", 512)
    url = server.add("resume.pth", RESUME.read_bytes())
    with open_checkpoint(url) as ckpt, open_checkpoint(RESUME) as local:
        for remote_record, local_record in zip(ckpt.tensors(), local.tensors()):
            assert ckpt.read_bytes(remote_record) == local.read_bytes(local_record)
        handle = ckpt._handle
        assert isinstance(handle, remote.RemoteFile) and handle._pool is not None
    sizes = [int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1
             for _, r in server.requests if r]  # fmt: skip
    assert max(sizes) <= max(512, remote.BLOCK * 2)


def test_diff_url_against_local(server: RangeServer) -> None:
    url = server.add("fine.pth", FINE.read_bytes())
    remote_result = run("diff", BASE, url, "--json")
    local_result = run("diff", BASE, FINE, "--json")
    assert remote_result.exit_code == local_result.exit_code == 1
    remote_report, local_report = json.loads(remote_result.stdout), json.loads(local_result.stdout)
    for report in (remote_report, local_report):
        report["b"].pop("path")
    assert remote_report == local_report
    same = run("diff", server.add("base.pth", BASE.read_bytes()), BASE)
    assert same.exit_code == 0, same.output


def test_verify_over_http_reads_every_byte_once(server: RangeServer) -> None:
    data = RESUME.read_bytes()
    url = server.add("resume.pth", data)
    result = run("verify", url, "--verbose")
    assert result.exit_code == 0, result.output
    assert "OK (torch-zip)" in result.stdout
    # verify opens the URL more than once: its size is counted once
    assert result.stderr.splitlines()[-1].endswith(
        f"bytes fetched of {len(data):,} (" + (f"{100 * server.bytes_sent / len(data):.3f} %)")
    )
    # every byte once, plus the few blocks the directory and local headers are read through
    assert len(data) <= server.bytes_sent <= len(data) + 12 * remote.BLOCK


def _verbose_counts(stderr: str) -> tuple[int, int]:
    """(requests, bytes fetched) from ``--verbose``'s last line."""
    words = stderr.splitlines()[-1].split()
    assert words[0] == "remote:" and words[4:7] == ["bytes", "fetched", "of"], stderr
    return int(words[1].replace(",", "")), int(words[3].replace(",", ""))


@pytest.mark.parametrize(
    "faults",
    [[], ["close", "short", "500"], ["stall"], ["close", "stall", "short"]],
    ids=["clean", "retried", "cancelled", "both"],
)
def test_verbose_counts_are_what_the_server_received_and_sent(
    server: RangeServer, monkeypatch: pytest.MonkeyPatch, faults: list[str]
) -> None:
    """``--verbose`` counts every request the server received and every body byte it sent,
    under retries (a body cut in half, a body a byte short, a 500) and a request the client
    gave up on (the server stays silent until the client hangs up): each failed attempt is
    counted, with the bytes it brought before it failed."""
    if "stall" in faults:
        # how long the stalled one waits
        monkeypatch.setattr(remote_backends, "TIMEOUT", scaled(2.0))
    data = RESUME.read_bytes()
    url = server.add("resume.pth", data)
    server.faults.extend(["ok", *faults])  # the open's request passes; each fault is retried
    result = run("verify", url, "--verbose")
    assert result.exit_code == 0, result.output
    assert not server.faults
    sent = server.bytes_sent  # once every request has been answered
    assert _verbose_counts(result.stderr) == (len(server.requests), sent)
    assert sent >= len(data)


def test_verify_finds_a_damaged_record_as_locally(server: RangeServer, tmp_path: Path) -> None:
    data = bytearray(RESUME.read_bytes())
    with open_checkpoint(RESUME) as ckpt:
        offset, _ = ckpt.storage_span(ckpt._parsed.storages[0])
    data[offset] ^= 0xFF
    local = tmp_path / "damaged.pth"
    local.write_bytes(data)
    url = server.add("damaged.pth", bytes(data))
    remote_result, local_result = run("verify", url, "--json"), run("verify", local, "--json")
    assert remote_result.exit_code == local_result.exit_code == 1
    problems = [json.loads(r.stdout)["files"][0]["problems"] for r in (remote_result, local_result)]
    assert problems[0] == problems[1] and "CRC-32" in problems[0][0]


def test_convert_url_to_local_file_equals_local_convert(
    server: RangeServer, tmp_path: Path
) -> None:
    url = server.add(RESUME.name, RESUME.read_bytes())
    from_url, from_file = tmp_path / "url.safetensors", tmp_path / "file.safetensors"
    result = run("convert", url, from_url, "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source"] == url
    assert run("convert", RESUME, from_file, "--dtype", "bf16").exit_code == 0
    assert from_url.read_bytes() == from_file.read_bytes()


def test_convert_url_without_dst_writes_its_name_here(
    server: RangeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = server.add("sub/pretrain_32.pth", (FIXTURES / "minimind/pretrain_32.pth").read_bytes())
    result = run("convert", url)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_32.safetensors"]


def test_convert_to_a_url_is_refused(server: RangeServer, tmp_path: Path) -> None:
    url = server.add("resume.pth", RESUME.read_bytes())
    result = run("convert", url, "s3://bucket/out.safetensors")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: s3://bucket/out.safetensors: convert writes to local")
    assert result.stderr.count("\n") == 1


# -- servers that do not honour Range ---------------------------------------------------------


def test_a_server_ignoring_range_is_refused_unless_asked(
    server: RangeServer, tmp_path: Path
) -> None:
    server.honour_range = False
    url = server.add(RESUME.name, RESUME.read_bytes())
    refused = run("show", url)
    assert refused.exit_code == 2
    assert refused.stderr == (
        f"Error: {url}: the server does not honour Range requests (it sends the whole file); "
        "pass --full-download to download it into memory\n"
    )
    assert show_json(url, "--full-download", "--stats") == show_json(RESUME, "--stats")
    out = tmp_path / "out.safetensors"
    assert run("convert", url, out, "--full-download").exit_code == 0
    assert run("convert", RESUME, tmp_path / "local.safetensors").exit_code == 0
    assert out.read_bytes() == (tmp_path / "local.safetensors").read_bytes()


# -- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["close", "500", "short", "stall"])
def test_a_transient_fault_is_retried(
    server: RangeServer, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # the stalled requests wait for the client to give up: this long (each other request is
    # answered at once, well within it)
    monkeypatch.setattr(remote_backends, "TIMEOUT", scaled(2.0))
    url = server.add("resume.pth", RESUME.read_bytes())
    server.faults.extend(["ok", fault, fault])  # the open's request passes; two faults follow
    assert show_json(url, "--stats") == show_json(RESUME, "--stats")
    assert not server.faults


@pytest.mark.parametrize("fault", ["close", "500", "short"])
def test_persistent_faults_end_in_one_line_and_nothing_written(
    server: RangeServer, tmp_path: Path, fault: str
) -> None:
    url = server.add("resume.pth", RESUME.read_bytes())
    server.faults.extend(["ok", *[fault] * 100])  # the open's request passes, no other
    result = run("convert", url, tmp_path / "out.safetensors")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"Error: {url}: network error after {remote.MAX_TRIES} ")
    assert result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache blocks and planned windows smaller than the fixture's tensors, so values are
    fetched when read (the fixture is small enough for a few default blocks, or one window, to
    hold all of it)."""
    monkeypatch.setattr(remote, "BLOCK", 256)
    monkeypatch.setattr(remote, "WINDOW", 256)


def _largest(records: list[Any]) -> Any:
    return max(records, key=lambda r: r.nbytes)


@pytest.mark.usefixtures("small_blocks")
def test_a_file_replaced_between_requests_is_detected(server: RangeServer) -> None:
    data = RESUME.read_bytes()
    url = server.add("resume.pth", data)
    with open_checkpoint(url) as ckpt:
        record = _largest(ckpt.tensors())
        server.replace("resume.pth", data[:-1] + bytes([data[-1] ^ 1]))  # same size
        with pytest.raises(InputError, match="changed while it was being read"):
            ckpt.read_bytes(record)
    server.replace("resume.pth", data)
    with open_checkpoint(url) as ckpt:
        record = _largest(ckpt.tensors())
        server.replace("resume.pth", data + b"\0")  # another size
        with pytest.raises(InputError, match="changed while it was being read"):
            ckpt.read_bytes(record)


@pytest.mark.usefixtures("small_blocks")
def test_convert_of_a_file_replaced_midway_writes_nothing(
    server: RangeServer, tmp_path: Path
) -> None:
    data = RESUME.read_bytes()
    url = server.add("resume.pth", data)
    replaced = []

    def replace_once(nbytes: int) -> None:
        if not replaced:
            replaced.append(nbytes)
            server.replace("resume.pth", bytes(reversed(data)))

    with pytest.raises(InputError, match="changed while it was being read"):
        convert(url, tmp_path / "out.safetensors", progress=replace_once)
    assert list(tmp_path.iterdir()) == []


# -- credentials, errors ----------------------------------------------------------------------


def test_missing_and_forbidden_are_one_line_errors(server: RangeServer) -> None:
    missing = run("show", server.url("nothing.pth"))
    assert missing.exit_code == 2
    assert missing.stderr == f"Error: {server.url('nothing.pth')}: no such file (HTTP 404)\n"
    server.require_token = "s3cret"
    url = server.add("resume.pth", RESUME.read_bytes())
    denied = run("show", url)
    assert denied.exit_code == 2
    assert denied.stderr.startswith(f"Error: {url}: access denied (HTTP 401)")


def test_messages_never_show_credentials_or_signatures(server: RangeServer) -> None:
    server.add("resume.pth", RESUME.read_bytes())
    host = server.url("")[len("http://") :].rstrip("/")
    url = f"http://user:hunter2@{host}/missing.pth?X-Amz-Signature=abcdef"
    result = run("show", url)
    assert result.exit_code == 2
    assert "hunter2" not in result.output and "abcdef" not in result.output
    assert result.stderr == f"Error: http://{host}/missing.pth: no such file (HTTP 404)\n"


def test_hf_urls_through_hf_endpoint_with_the_token(
    server: RangeServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``hf://org/repo@rev/path`` is the hub's resolve URL on HF_ENDPOINT; the token goes to the
    hub, not to the host it redirects to (the hub sends file bytes from a CDN)."""
    server.add("cdn/blob", RESUME.read_bytes())
    cdn = server.url("cdn/blob").replace("127.0.0.1", "localhost")  # another host
    server.redirects["/org/model/resolve/v1/resume.pth"] = cdn
    server.require_token = "hf_token_value"
    monkeypatch.setenv("HF_ENDPOINT", server.url("").rstrip("/"))
    monkeypatch.setenv("HF_TOKEN", "hf_token_value")
    denied = run("show", "hf://org/model@v1/resume.pth")
    assert denied.exit_code == 2, denied.output  # the CDN got no token: 401 there
    assert "hf_token_value" not in denied.output
    server.require_token = None
    assert show_json("hf://org/model@v1/resume.pth") == show_json(RESUME)
    assert server.requests[-1][0] == "/cdn/blob"


def test_a_protocol_without_its_package_names_it() -> None:
    result = run("show", "gs://bucket/model.pth")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: gs://bucket/model.pth: reading gs:// URLs needs gcsfs")


# -- an S3-compatible server ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = _free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    yield f"http://127.0.0.1:{port}"
    moto.stop()


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket with the fixtures in it; credentials and endpoint found the standard way."""
    import boto3

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    client = boto3.client("s3")
    client.create_bucket(Bucket="ckpts")
    for local in (RESUME, SAFETENSORS, FINE):
        client.put_object(Bucket="ckpts", Key=f"run1/{local.name}", Body=local.read_bytes())
    return "s3://ckpts/run1"


def test_s3_show_stats_verify_convert(bucket: str, tmp_path: Path) -> None:
    for local in (RESUME, SAFETENSORS):
        url = f"{bucket}/{local.name}"
        assert show_json(url, "--stats") == show_json(local, "--stats")
        verified = run("verify", url)
        assert verified.exit_code == 0, verified.output
    out, expected = tmp_path / "s3.safetensors", tmp_path / "local.safetensors"
    assert run("convert", f"{bucket}/{RESUME.name}", out).exit_code == 0
    assert run("convert", RESUME, expected).exit_code == 0
    assert out.read_bytes() == expected.read_bytes()
    assert run("diff", f"{bucket}/{FINE.name}", FINE).exit_code == 0


def test_s3_missing_object_and_replaced_object(bucket: str, tmp_path: Path) -> None:
    missing = run("show", f"{bucket}/nothing.pth")
    assert missing.exit_code == 2
    assert missing.stderr == f"Error: {bucket}/nothing.pth: no such file\n"
    import boto3

    replaced = []

    def replace_once(nbytes: int) -> None:
        if not replaced:
            replaced.append(nbytes)
            boto3.client("s3").put_object(
                Bucket="ckpts", Key=f"run1/{RESUME.name}", Body=FINE.read_bytes()
            )

    with pytest.raises(InputError, match="changed while it was being read"):
        convert(f"{bucket}/{RESUME.name}", tmp_path / "out.safetensors", progress=replace_once)
    assert list(tmp_path.iterdir()) == []


def test_convert_from_a_url_verifies_against_what_it_read(
    server: RangeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remote source is not fetched twice: the output is read back against the CRC-32 of
    the bytes written, which still catches an output that differs."""
    import ckpttool.commands.convert.run as convert_module

    monkeypatch.setattr(remote, "BLOCK", 256)  # the cache holds 16 KiB: no second pass from it
    url = server.add(RESUME.name, RESUME.read_bytes())
    assert run("show", url).exit_code == 0
    metadata_bytes, server.bytes_sent = server.bytes_sent, 0
    out = tmp_path / "out.safetensors"
    converted = run("convert", url, out, "--json")
    assert converted.exit_code == 0, converted.output
    tensor_bytes = json.loads(converted.stdout)["tensor_bytes"]
    assert "note: verified against the CRC-32 of each tensor as fetched" in converted.stderr
    # the model's tensors once (and the metadata again), not twice
    assert server.bytes_sent < metadata_bytes + 1.5 * tensor_bytes
    stored = convert_module._stored_bytes

    def damaged(written: Any, record: Any) -> Any:
        got = stored(written, record)
        return None if got is None else memoryview(bytes(got)[:-1] + bytes([got[-1] ^ 1]))

    monkeypatch.setattr(convert_module, "_stored_bytes", damaged)
    result = run("convert", url, tmp_path / "again.safetensors")
    assert result.exit_code == 1, result.output
    assert "does not read back bit-for-bit equal" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]


# -- torch.distributed.checkpoint directories ---------------------------------------------------

DCP = FIXTURES / "dcp/checkpoint"


def _serve_directory(server: RangeServer, directory: Path, prefix: str) -> str:
    for member in directory.iterdir():
        server.add(f"{prefix}/{member.name}", member.read_bytes())
    return server.url(prefix) + "/"


def test_a_dcp_directory_over_http(server: RangeServer, tmp_path: Path) -> None:
    url = _serve_directory(server, DCP, DCP.name)  # the output's metadata names the source
    assert show_json(url, "--stats") == show_json(DCP, "--stats")
    verified = run("verify", url, "--json")
    assert verified.exit_code == 0, verified.output
    local = json.loads(run("verify", DCP, "--json").stdout)["files"][0]
    found = json.loads(verified.stdout)["files"][0]
    assert found["checked"] == local["checked"] and found["problems"] == []
    out, expected = tmp_path / "url.safetensors", tmp_path / "local.safetensors"
    assert run("convert", url, out).exit_code == 0
    assert run("convert", DCP, expected).exit_code == 0
    assert out.read_bytes() == expected.read_bytes()


def test_a_dcp_directory_with_a_missing_rank_file_over_http(server: RangeServer) -> None:
    url = _serve_directory(server, DCP, "step_1200")
    del server.files["/step_1200/__1_0.distcp"]
    result = run("show", url)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {url}") and "__1_0.distcp" in result.stderr


def test_a_remote_directory_without_metadata_is_refused(server: RangeServer) -> None:
    url = server.url("nothing") + "/"
    result = run("show", url)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {url.rstrip('/')}")
    assert "only torch.distributed.checkpoint ones are read from http(s)://" in result.stderr


def test_a_dcp_directory_in_s3(bucket: str, tmp_path: Path) -> None:
    import boto3

    client = boto3.client("s3")
    for member in DCP.iterdir():
        client.put_object(Bucket="ckpts", Key=f"run1/dcp/{member.name}", Body=member.read_bytes())
    client.put_object(Bucket="ckpts", Key="run1/dcp/__7_0.distcp", Body=b"stray")
    url = f"{bucket}/dcp"  # a prefix the store lists: no trailing slash needed
    assert show_json(url, "--stats") == show_json(DCP, "--stats")
    verified = run("verify", url, "--json")
    assert verified.exit_code == 0, verified.output
    checked = json.loads(verified.stdout)["files"][0]["checked"]
    assert "note: data files the metadata does not refer to: __7_0.distcp" in checked
    assert run("diff", url, DCP).exit_code == 0


def test_convert_fetches_the_next_tensor_while_writing_and_uses_it(
    server: RangeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the fixture's tensors over the prefetch threshold: the output is the local one, and
    each tensor is fetched once (a prefetch thrown away would be fetched again). A legacy file:
    its format gives no regions to plan (a torch zip's are fetched in windows: tests/test_remote_coalescing.py)."""
    for name, value in {"BLOCK": 256, "SMALL_READ": 64, "PART": 1024}.items():
        monkeypatch.setattr(remote, name, value)
    prefetched = []
    original = remote.RemoteFile.prefetch

    def counting(self: remote.RemoteFile, offset: int, length: int) -> None:
        prefetched.append(length)
        original(self, offset, length)

    monkeypatch.setattr(remote.RemoteFile, "prefetch", counting)
    url = server.add(LEGACY.name, LEGACY.read_bytes())
    assert run("show", url).exit_code == 0
    metadata_bytes, server.bytes_sent = server.bytes_sent, 0
    out, expected = tmp_path / "url.safetensors", tmp_path / "local.safetensors"
    converted = run("convert", url, out, "--json")
    assert converted.exit_code == 0, converted.output
    assert run("convert", LEGACY, expected).exit_code == 0
    assert out.read_bytes() == expected.read_bytes()
    assert len(prefetched) >= 5
    tensor_bytes = json.loads(converted.stdout)["tensor_bytes"]
    assert server.bytes_sent < metadata_bytes + 1.5 * tensor_bytes


def test_scan_a_url_as_a_local_file(server: RangeServer) -> None:
    for target, local in [
        (server.add(RESUME.name, RESUME.read_bytes()), RESUME),
        (_serve_directory(server, DCP, DCP.name), DCP),
    ]:
        scanned, expected = run("scan", target, "--json"), run("scan", local, "--json")
        assert scanned.exit_code == expected.exit_code == 0, scanned.output
        files = [json.loads(r.stdout)["files"][0] for r in (scanned, expected)]
        for found in files:
            found.pop("path")
        assert files[0] == files[1]


def test_rescale_step_refuses_a_url(server: RangeServer) -> None:
    url = server.add("resume.pth", RESUME.read_bytes())
    result = run("rescale-step", url, "--world-size", "4", "--from-world-size", "8")
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {url}: rescale-step rewrites a local file (atomically, with a rename); "
        "download the checkpoint first\n"
    )
    assert server.requests == []


# -- framework directories in an object store ---------------------------------------------------

FRAMEWORKS = FIXTURES / "frameworks"


def _upload_tree(local: Path, key: str) -> str:
    import boto3

    client = boto3.client("s3")
    for member in sorted(p for p in local.rglob("*") if p.is_file()):
        relative = member.relative_to(local).as_posix()
        client.put_object(Bucket="ckpts", Key=f"{key}/{relative}", Body=member.read_bytes())
    return f"s3://ckpts/{key}"


@pytest.mark.parametrize(
    "relative",
    [
        "hf_sharded",
        "hf_bin_sharded",
        "hf_model",
        "accelerate_2proc/state",
        "trainer_2proc/output/checkpoint-8",
    ],
)
def test_framework_directories_in_s3(bucket: str, tmp_path: Path, relative: str) -> None:
    local = FRAMEWORKS / relative
    url = _upload_tree(local, f"dirs/{relative}")
    assert show_json(url, "--stats") == show_json(local, "--stats")
    verified = run("verify", url, "--json")
    assert verified.exit_code == run("verify", local).exit_code, verified.output
    assert run("diff", url, local).exit_code == 0
    out, expected = tmp_path / "url.safetensors", tmp_path / "local.safetensors"
    assert run("convert", url, out).exit_code == 0
    assert run("convert", local, expected).exit_code == 0
    assert out.read_bytes() == expected.read_bytes()


def test_a_shard_replaced_during_convert_writes_nothing(bucket: str, tmp_path: Path) -> None:
    """A directory's member files are asked again for their size and ETag before convert
    commits its output, like a single file's."""
    import boto3

    from ckpttool.commands.convert.run import convert
    from ckpttool.errors import InputError

    local = FRAMEWORKS / "hf_sharded"
    url = _upload_tree(local, "dirs/replaced")
    name = "model-00002-of-00003.safetensors"
    replaced: list[int] = []

    def replace_once(nbytes: int) -> None:
        if not replaced:
            replaced.append(nbytes)
            data = bytearray((local / name).read_bytes())
            data[-1] ^= 1  # same size, another last byte
            boto3.client("s3").put_object(
                Bucket="ckpts", Key=f"dirs/replaced/{name}", Body=bytes(data)
            )

    with pytest.raises(InputError, match=f"{name}: the file changed while it was being read"):
        convert(url, tmp_path / "model.safetensors", progress=replace_once)
    assert replaced and list(tmp_path.iterdir()) == []


def test_an_index_file_in_s3(bucket: str) -> None:
    local = FRAMEWORKS / "hf_sharded"
    url = _upload_tree(local, "dirs/index_only")
    index = "model.safetensors.index.json"
    assert show_json(f"{url}/{index}") == show_json(local / index)


def test_a_framework_directory_over_http_is_refused_with_the_reason(server: RangeServer) -> None:
    url = _serve_directory(server, FRAMEWORKS / "hf_model", "hf_model")
    result = run("show", url)
    assert result.exit_code == 2
    assert "HTTP cannot list a directory" in result.stderr


def test_a_model_directory_from_s3(bucket: str, tmp_path: Path) -> None:
    """A from_pretrained directory written from a Trainer checkpoint in a bucket: the same
    files, byte for byte, as from the local checkpoint (config.json fetched and copied)."""
    local = next((FRAMEWORKS / "trainer_2proc").rglob("checkpoint-*"))
    url = _upload_tree(local, f"dirs/trainer/{local.name}")
    from_url, from_file = tmp_path / "url", tmp_path / "local"
    assert run("convert", url, f"{from_url}/").exit_code == 0
    assert run("convert", local, f"{from_file}/").exit_code == 0
    names = sorted(p.name for p in from_file.iterdir())
    assert "config.json" in names and sorted(p.name for p in from_url.iterdir()) == names
    for name in names:
        assert (from_url / name).read_bytes() == (from_file / name).read_bytes(), name


# -- any fsspec protocol ------------------------------------------------------------------------


def test_any_fsspec_protocol_reads_like_a_file() -> None:
    """fsspec's in-memory filesystem stands for the protocols not started here (gs, az...):
    the same code path, through fsspec's own registry."""
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/ckpts/resume.pth", RESUME.read_bytes())
    try:
        assert show_json("memory://ckpts/resume.pth", "--stats") == show_json(RESUME, "--stats")
        assert run("verify", "memory://ckpts/resume.pth").exit_code == 0
    finally:
        memory.rm("/ckpts", recursive=True)


def test_a_permission_failure_is_one_line_naming_the_url() -> None:
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Denied(MemoryFileSystem):
        protocol = "denied"

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            raise PermissionError("AccessDenied: secret-key-id=AKIA... is not allowed")

    fsspec.register_implementation("denied", Denied, clobber=True)
    result = run("show", "denied://bucket/run1/model.pth")
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: denied://bucket/run1/model.pth: access denied; check this protocol's credentials "
        "(environment, profile files)\n"
    )
