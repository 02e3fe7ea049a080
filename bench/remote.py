"""``ckpttool`` on URLs against the same commands on local files (issue 17), over loopback HTTP.

Run from the repository root: ``python -m bench.remote [--runs 3]``. Builds the MiniMind-768
files if needed (:mod:`bench.build`), serves them from disk with the tests' Range-honouring
server (``tests/support/range_server.py``, in this process, on 127.0.0.1) and prints:

1. ``show`` of the resume file (~1.25 GB), local and by URL, with the requests and bytes the
   URL's show fetched (``--verbose``), and the target: 2x the local show plus its round trips;
2. ``convert`` of the fp16 weights file (~218 MB) to safetensors: local, by URL, and a plain
   streaming download (``urllib``, 1 MiB reads) followed by a local convert, with peak memory;
3. ``verify`` of the same file, local and by URL, with the bytes the URL's verify fetched.

The server shares the machine's cores with the measured command: on a 2-core VM the URL rows
pay for the server too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

from bench.build import weights_and_resume
from bench.harness import compare
from tests.support.range_server import RangeServer

DOWNLOAD = """
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1]) as response, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(response, out, 1 << 20)
"""


def _ckpttool(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *args]


def _round_trip_s(url: str, samples: int = 20) -> float:
    """Median time of a one-byte ranged GET on a fresh connection (what each request costs)."""
    times = []
    for _ in range(samples):
        request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
        start = time.perf_counter()
        with urllib.request.urlopen(request) as response:
            response.read()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _fetched(url: str, command: str = "show") -> tuple[int, int, int]:
    """(requests, bytes fetched, file size) that ``ckpttool COMMAND URL --verbose`` reports."""
    result = subprocess.run(
        _ckpttool(command, url, "--verbose"), capture_output=True, text=True, check=True
    )
    line = result.stderr.strip().splitlines()[-1]
    match = re.match(r"remote: ([\d,]+) requests, ([\d,]+) bytes fetched of ([\d,]+)", line)
    assert match, line
    requests, fetched, size = (int(group.replace(",", "")) for group in match.groups())
    return requests, fetched, size


def main(argv: list[str] | None = None) -> int:
    args, weights, resume, work = weights_and_resume(
        argv, "python -m bench.remote", __doc__, "remote_out"
    )
    server = RangeServer().start()
    try:
        resume_url = server.add_path(resume.name, resume)
        weights_url = server.add_path(weights.name, weights)

        requests, fetched, size = _fetched(resume_url)
        round_trip = _round_trip_s(resume_url)
        print(f"\n### show {resume.name} ({size / 1e9:.2f} GB)\n")
        print(
            f"URL show: {requests} requests, {fetched:,} bytes fetched of {size:,} "
            f"({100 * fetched / size:.4f} %; target <= 0.1 %); one round trip "
            f"{round_trip * 1e3:.2f} ms\n"
        )
        rows = {
            "ckpttool show FILE": _ckpttool("show", str(resume)),
            "ckpttool show URL": _ckpttool("show", resume_url),
        }
        print(compare(rows, "ckpttool show FILE", runs=args.runs, warmup=args.warmup))
        print(f"\ntarget for the URL row: 2 x FILE + {requests} x {round_trip * 1e3:.2f} ms")

        print(f"\n### convert {weights.name} ({weights.stat().st_size / 1e6:.0f} MB, fp16)\n")
        local_out, url_out = work / "local.safetensors", work / "url.safetensors"
        downloaded, dl_out = work / "downloaded.pth", work / "downloaded.safetensors"
        download_then_convert = [
            "sh", "-c",
            f'"{sys.executable}" -c "$0" "$1" "$2" && "{sys.executable}" -m ckpttool convert '
            '"$2" "$3" --force',
            DOWNLOAD, weights_url, str(downloaded), str(dl_out),
        ]  # fmt: skip
        rows = {
            "ckpttool convert FILE": _ckpttool("convert", str(weights), str(local_out), "--force"),
            "download (urllib, streaming) + ckpttool convert FILE": download_then_convert,
            "ckpttool convert URL": _ckpttool("convert", weights_url, str(url_out), "--force"),
        }
        print(compare(rows, "download (urllib, streaming) + ckpttool convert FILE",
                      runs=args.runs, warmup=args.warmup))  # fmt: skip
        same = url_out.read_bytes() == local_out.read_bytes()
        print(f"\nURL output identical to the local output: {same}")

        requests, fetched, size = _fetched(weights_url, "verify")
        print(f"\n### verify {weights.name}\n")
        print(f"URL verify: {requests} requests, {fetched:,} bytes fetched of {size:,}\n")
        rows = {
            "ckpttool verify FILE": _ckpttool("verify", str(weights)),
            "ckpttool verify URL": _ckpttool("verify", weights_url),
        }
        print(compare(rows, "ckpttool verify FILE", runs=args.runs, warmup=args.warmup))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
