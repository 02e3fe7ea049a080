"""ckpttool against torch and the C unpickler as the tensor count grows (issue 13).

Run from the repository root: ``python -m bench.tensor_count [--sizes 585,20000,100000]
[--repeat 3]``. For each size N it builds (once) under ``bench/data/tensor_count/``:

* ``weights_N.pth``: ``{f"layers.{i // 8}.p{i % 8}.weight": torch.zeros(4, 4) for i in range(N)}``
  saved by ``torch.save``, and ``weights_N_changed.pth``, the same with one element of one tensor
  set to 1 (the other side of ``diff``);
* ``resume_N.pth``: ``{"model", "optimizer", "epoch", "step"}`` with N // 4 4x4 parameters and
  torch's AdamW state after one ``step()`` (``exp_avg``, ``exp_avg_sq`` and a 0-dim ``step`` per
  parameter): N tensors in all; ``resume_N_copy.pth`` is a byte copy;
* ``dcp_N/``: ``{"model": the weights dict, "step": 1200}`` saved with
  ``torch.distributed.checkpoint`` by a real 2-process gloo group (every entry replicated, so
  DCP's planner spreads them over both ranks' files): N entries in ``.metadata``;
  ``dcp_N_copy/`` is a byte copy (the other side of ``diff``).

Then, per size and file kind, one interleaved run (:mod:`bench.harness`: fresh process per run,
median wall time from spawn to reap, median peak RSS from ``wait4``; the inputs are read into
the page cache first, in place of a warmup run of every command) of ``ckpttool show`` (table
and ``--json``), ``diff``, ``convert`` to safetensors and ``verify`` against the torch way of
doing each and the C-unpickler floor (``pickle.Unpickler`` with stub ``find_class`` and
``persistent_load`` over ``data.pkl``, or over DCP's ``.metadata``: no torch imported). Prints
the harness's tables, a table of ckpttool/torch ratios per operation, and the per-tensor peak
RSS of ``show`` from the slope between the sizes.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from itertools import pairwise
from pathlib import Path

import torch

from bench.build import DEFAULT_OUT
from bench.diff import SCRIPT as DIFF_SCRIPT
from bench.diff import _tolerating_exit_1
from bench.harness import Result, measure_all, table

DEFAULT_SIZES = (585, 20_000, 100_000)

# The floor: the C unpickler building stub objects for every opcode, nothing imported from torch.
# Stub is a dict subclass so that the OrderedDicts torch's pickles rebuild still take SETITEMS.
# No __eq__ override: hashes are identities, so no two stub keys collide.
C_FLOOR = """
import pickle, sys, zipfile
class Stub(dict):
    def __init__(self, *args, **kwargs):
        pass
    def __setstate__(self, state):
        pass
    __hash__ = object.__hash__  # DCP's .metadata keys a dict by dataclasses
class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return Stub
    def persistent_load(self, pid):
        return pid
path = sys.argv[1]
if path.endswith(".metadata"):
    with open(path, "rb") as f:
        Unpickler(f).load()
else:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        with archive.open(name) as f:
            Unpickler(f).load()
"""

TORCH_LOAD_MMAP = """
import sys, torch
torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
"""

# verify's torch counterpart: read every byte of every storage (torch checks the records' CRC-32)
TORCH_LOAD_FULL = """
import sys, torch
torch.load(sys.argv[1], map_location="cpu", weights_only=True)
"""

TORCH_TO_SAFETENSORS = """
import sys, torch
from safetensors.torch import save_file
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
if sys.argv[3] != "-":
    state = state[sys.argv[3]]
save_file(state, sys.argv[2])
"""

DCP_READ_METADATA = """
import sys
from torch.distributed.checkpoint import FileSystemReader
FileSystemReader(sys.argv[1]).read_metadata()
"""

# verify's and diff's torch counterparts for a DCP directory: read every chunk of every entry
# into memory (what dcp_to_torch_save reads, without the save), and compare two such reads
DCP_LOAD_ALL = """
import sys, warnings
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
warnings.simplefilter("ignore")
_load_state_dict_from_keys(checkpoint_id=sys.argv[1])
"""

DCP_DIFF = """
import sys, warnings, torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
warnings.simplefilter("ignore")
def flat(obj, prefix=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from flat(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, obj
a = dict(flat(_load_state_dict_from_keys(checkpoint_id=sys.argv[1])))
b = dict(flat(_load_state_dict_from_keys(checkpoint_id=sys.argv[2])))
def same(x, y):
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return torch.equal(x, y)
    return x == y
differ = [k for k in a if k not in b or not same(a[k], b[k])] + [k for k in b if k not in a]
print(len(a), "entries,", len(differ), "differ")
sys.exit(1 if differ else 0)
"""

DCP_TO_TORCH_SAVE = """
import sys, warnings
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
warnings.simplefilter("ignore")
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def weights_state(count: int) -> dict[str, torch.Tensor]:
    """The issue's state dict: ``count`` 4x4 fp32 zeros, eight per "layer"."""
    return {f"layers.{i // 8}.p{i % 8}.weight": torch.zeros(4, 4) for i in range(count)}


def _save(obj: object, target: Path) -> Path:
    temp = target.with_name(target.name + ".tmp")
    torch.save(obj, temp)
    temp.rename(target)
    return target


def build_weights_pair(out_dir: Path, count: int) -> tuple[Path, Path]:
    """``weights_N.pth`` and ``weights_N_changed.pth`` (one element of the middle tensor is 1)."""
    plain, changed = out_dir / f"weights_{count}.pth", out_dir / f"weights_{count}_changed.pth"
    if not (plain.exists() and changed.exists()):
        print(f"building {plain.name} and {changed.name} ...", file=sys.stderr, flush=True)
        state = weights_state(count)
        _save(state, plain)
        state[f"layers.{(count // 2) // 8}.p{(count // 2) % 8}.weight"][0, 0] = 1.0
        _save(state, changed)
    return plain, changed


def build_resume_pair(out_dir: Path, count: int) -> tuple[Path, Path]:
    """``resume_N.pth`` (model of N // 4 parameters + AdamW state: N tensors) and a byte copy."""
    resume, copy = out_dir / f"resume_{count}.pth", out_dir / f"resume_{count}_copy.pth"
    if not resume.exists():
        print(f"building {resume.name} ...", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        model = weights_state(max(count // 4, 1))
        params = [torch.nn.Parameter(value.clone()) for value in model.values()]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
        state = {
            "model": {key: param.detach() for key, param in zip(model, params, strict=True)},
            "optimizer": optimizer.state_dict(),
            "epoch": 1,
            "step": 1200,
        }
        _save(state, resume)
    if not copy.exists():
        temp = copy.with_name(copy.name + ".tmp")
        shutil.copyfile(resume, temp)
        temp.rename(copy)
    return resume, copy


def _dcp_rank(rank: int, port: int, out: str, count: int) -> None:
    """One rank of the DCP save: both hold the same replicated state dict."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(minutes=30),
    )  # fmt: skip
    try:
        dcp.save({"model": weights_state(count), "step": 1200}, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def build_dcp(out_dir: Path, count: int) -> Path:
    """``dcp_N/``, written to ``dcp_N.tmp`` by two gloo ranks and renamed when complete."""
    import torch.multiprocessing as mp

    target = out_dir / f"dcp_{count}"
    if target.is_dir():
        return target
    temp = out_dir / f"dcp_{count}.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    print(f"building {target.name} (2 ranks) ...", file=sys.stderr, flush=True)
    mp.spawn(_dcp_rank, args=(port, str(temp), count), nprocs=2, join=True)
    temp.rename(target)
    return target


def dcp_copy(source: Path) -> Path:
    """``dcp_N_copy/``: a byte copy of ``dcp_N/`` (the other side of ``diff``)."""
    copy = source.with_name(source.name + "_copy")
    if not copy.is_dir():
        temp = source.with_name(source.name + "_copy.tmp")
        shutil.rmtree(temp, ignore_errors=True)
        shutil.copytree(source, temp)
        temp.rename(copy)
    return copy


def _read_into_page_cache(out_dir: Path, count: int) -> None:
    """Read every input of size ``count`` once, so that no measured run reads from the disk."""
    paths = [*out_dir.glob(f"*_{count}.pth"), *out_dir.glob(f"*_{count}_*.pth")]
    for directory in (f"dcp_{count}", f"dcp_{count}_copy"):
        paths += [p for p in (out_dir / directory).glob("*") if p.is_file()]
    for path in paths:
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass


def _python(script: str, *args: object) -> list[str]:
    return [sys.executable, "-c", script, *(str(a) for a in args)]


def _ckpttool(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckpttool", *(str(a) for a in args)]


# (operation, ckpttool row, torch row): the ratios the targets are stated in
PAIRS = (
    ("show --json vs torch.load mmap", "ckpttool show --json", "torch.load(mmap=True)"),
    ("show --json vs C floor", "ckpttool show --json", "C pickle.Unpickler floor"),
    ("show (table) vs torch.load mmap", "ckpttool show", "torch.load(mmap=True)"),
    ("diff", "ckpttool diff", "torch: load both (mmap) + torch.equal"),
    ("convert", "ckpttool convert", "torch: load (mmap) + save_file"),
    ("verify", "ckpttool verify", "torch.load (full read)"),
    (
        "show --json vs read_metadata",
        "ckpttool show --json",
        "torch: FileSystemReader.read_metadata",
    ),
    ("show (table) vs read_metadata", "ckpttool show", "torch: FileSystemReader.read_metadata"),
    ("convert (DCP)", "ckpttool convert", "torch: dcp_to_torch_save"),
    ("diff (DCP)", "ckpttool diff", "torch: load both (DCP) + torch.equal"),
    ("verify (DCP)", "ckpttool verify", "torch: load every chunk (DCP)"),
)


def torch_file_rows(a: Path, b: Path, section: str, work: Path) -> dict[str, list[str]]:
    """Every measured command on a torch zip file ``a`` (``b``: the other side of the diff)."""
    out = work / f"{a.stem}"
    return {
        "torch.load(mmap=True)": _python(TORCH_LOAD_MMAP, a),
        "C pickle.Unpickler floor": _python(C_FLOOR, a),
        "ckpttool show": _ckpttool("show", a),
        "ckpttool show --json": _ckpttool("show", a, "--json"),
        "torch: load both (mmap) + torch.equal": _tolerating_exit_1(
            _python(DIFF_SCRIPT, a, b, "mmap")
        ),
        "ckpttool diff": _tolerating_exit_1(_ckpttool("diff", a, b)),
        "torch: load (mmap) + save_file": _python(
            TORCH_TO_SAFETENSORS, a, f"{out}_torch.safetensors", section
        ),
        "ckpttool convert": _ckpttool("convert", a, f"{out}_ckpttool.safetensors", "--force"),
        "torch.load (full read)": _python(TORCH_LOAD_FULL, a),
        "ckpttool verify": _ckpttool("verify", a),
    }


def dcp_rows(source: Path, copy: Path, work: Path) -> dict[str, list[str]]:
    """Every measured command on a DCP directory ``source`` (``copy``: the other side of the
    diff, a byte copy)."""
    out = work / source.name
    return {
        "torch: FileSystemReader.read_metadata": _python(DCP_READ_METADATA, source),
        "C pickle.Unpickler floor": _python(C_FLOOR, source / ".metadata"),
        "ckpttool show": _ckpttool("show", source),
        "ckpttool show --json": _ckpttool("show", source, "--json"),
        "torch: load both (DCP) + torch.equal": _tolerating_exit_1(_python(DCP_DIFF, source, copy)),
        "ckpttool diff": _tolerating_exit_1(_ckpttool("diff", source, copy)),
        "torch: dcp_to_torch_save": _python(DCP_TO_TORCH_SAVE, source, f"{out}_torch.pth"),
        "ckpttool convert": _ckpttool(
            "convert", source, f"{out}_ckpttool.safetensors", "--section", "model", "--force"
        ),
        "torch: load every chunk (DCP)": _python(DCP_LOAD_ALL, source),
        "ckpttool verify": _ckpttool("verify", source),
    }


def ratio_table(rows: Sequence[tuple[int, str, Mapping[str, Result]]]) -> str:
    """ckpttool / torch (or floor) ratios of wall time and peak RSS, one line per size and op."""
    lines = [
        "| tensors | file | operation | wall ratio | RSS ratio |",
        "|---:|---|---|---:|---:|",
    ]
    for count, kind, results in rows:
        for operation, ours, theirs in PAIRS:
            if ours in results and theirs in results:
                a, b = results[ours], results[theirs]
                lines.append(
                    f"| {count:,} | {kind} | {operation} "
                    f"| {a.median_wall_s / b.median_wall_s:.2f}x "
                    f"| {a.median_peak_rss_mb / b.median_peak_rss_mb:.2f}x |"
                )
    return "\n".join(lines)


def slope_table(rows: Sequence[tuple[int, str, Mapping[str, Result]]]) -> str:
    """Bytes of peak RSS per tensor of ``show``, from the slope between consecutive sizes."""
    lines = ["| file | command | sizes | peak RSS per tensor (bytes) |", "|---|---|---|---:|"]
    kinds = dict.fromkeys(kind for _, kind, _ in rows)
    for kind in kinds:
        series = sorted(
            ((count, results) for count, k, results in rows if k == kind), key=lambda row: row[0]
        )
        for command in ("ckpttool show", "ckpttool show --json", "torch.load(mmap=True)"):
            for (n0, r0), (n1, r1) in pairwise(series):
                if command in r0 and command in r1:
                    delta = r1[command].median_peak_rss_mb - r0[command].median_peak_rss_mb
                    per_tensor = delta * 1024 * 1024 / (n1 - n0)
                    lines.append(f"| {kind} | {command} | {n0:,} to {n1:,} | {per_tensor:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_count", description=__doc__)
    parser.add_argument(
        "--sizes",
        default=",".join(str(n) for n in DEFAULT_SIZES),
        help="comma-separated tensor counts (default: %(default)s; quick: 585,20000)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per command")
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="discarded runs per command (default: %(default)s; the files are read into the page "
        "cache before measuring instead, which costs seconds where a warmup run of every "
        "command costs minutes at 100,000 tensors)",
    )
    parser.add_argument(
        "--kinds", default="weights,resume,dcp", help="which files (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "tensor_count")
    args = parser.parse_args(argv)
    sizes = [int(size.replace("_", "")) for size in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "out"
    work.mkdir(exist_ok=True)
    measured: list[tuple[int, str, Mapping[str, Result]]] = []
    for count in sizes:
        jobs: list[tuple[str, str, dict[str, list[str]]]] = []
        if "weights" in kinds:
            a, b = build_weights_pair(args.out, count)
            rows = torch_file_rows(a, b, "-", work)
            jobs.append(("weights", f"{a.name} vs {b.name}", rows))
        if "resume" in kinds:
            a, b = build_resume_pair(args.out, count)
            jobs.append(("resume", f"{a.name} vs {b.name}", torch_file_rows(a, b, "model", work)))
        if "dcp" in kinds:
            source = build_dcp(args.out, count)
            copy = dcp_copy(source)
            title = f"{source.name}/ (2 ranks) vs {copy.name}/"
            jobs.append(("dcp", title, dcp_rows(source, copy, work)))
        for kind, title, rows in jobs:
            baseline = next(iter(rows))
            _read_into_page_cache(args.out, count)
            print(f"\n#### {count:,} tensors, {kind}: {title}\n", flush=True)
            results = measure_all(rows, runs=args.repeat, warmup=args.warmup)
            print(table(results, baseline), flush=True)
            measured.append((count, kind, results))
    print("\n#### ckpttool against the torch way (and the C floor)\n")
    print(ratio_table(measured))
    if len(sizes) > 1:
        print("\n#### Peak RSS per tensor (slope between sizes)\n")
        print(slope_table(measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
