"""`ckpttool show` against each library's own load, on the layouts of issue 40.

    python -m bench.library_layouts [--runs 5] [--group fixtures|pickles|large|large-read|all]
                                    [--ultralytics-site DIR] [--torchao-0.13-site DIR]

For each checkpoint, two processes run interleaved by :mod:`bench.harness` (fresh process per
run, warm page cache, median wall time from spawn to reap, median peak RSS from ``wait4``):
``python -m ckpttool show PATH`` and a Python process that loads it the way the library's users
do, offline (``HF_HUB_OFFLINE=1``, ``YOLO_OFFLINE=1``):

* ``fixtures``: the committed folders under ``tests/fixtures/folders/``: a sentence-transformers
  model (``SentenceTransformer(dir)``), diffusers ``UNet2DConditionModel`` folders (safetensors,
  ``.bin``, sharded; ``UNet2DConditionModel.from_pretrained(dir)``), an ``EMAModel`` save
  (``EMAModel.from_pretrained(dir, model_cls=UNet2DConditionModel)``) and an LDM pipeline
  (``DiffusionPipeline.from_pretrained(dir)``);
* ``pickles``: ultralytics ``last.pt``/``best.pt`` (``YOLO(path)``: needs ultralytics, see
  ``--ultralytics-site``), mmengine's ``iter_2.pth``, the torchao state dicts and nanoGPT's
  ``ckpt.pt`` (``torch.load(path, weights_only=False)``, what each one's loader calls), and a
  ``torch.export`` archive built here from a tiny model (``torch.export.load``);
* ``large``: what users download, built once into ``bench/data/library_layouts/`` with random
  weights: a ``UNet2DConditionModel`` with Stable Diffusion 1.x's layout at 0.4x its widths
  (142M parameters, 569 MB of fp32 safetensors) and a sentence-transformer around a BERT-base
  model (110M parameters, 438 MB);
* ``large-read``: the same two with every weight in hand and read (summed, as a first inference
  reads them): ``ckpttool.load_state_dict(dir)`` against the library's load + ``state_dict()``.

The fixtures are tiny: their rows measure start-up and imports (``python -c "import torch"``,
``import diffusers``... are printed as floors). ultralytics is not in the virtual environment
(see ``tests/fixtures/ultralytics/README.md``); its rows are left out unless ``--ultralytics-site``
names a folder where it was installed with ``pip install --target``, or it is importable. The
torchao ``aqt_*`` files load only with torchao 0.13 (the release that wrote them): their rows need
``--torchao-0.13-site``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.build import DEFAULT_OUT
from bench.harness import Result, measure_all

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

ST_LOAD = "import sys; from sentence_transformers import SentenceTransformer\n" \
    "SentenceTransformer(sys.argv[1], device='cpu')"  # fmt: skip
UNET_LOAD = "import sys; from diffusers import UNet2DConditionModel\n" \
    "UNet2DConditionModel.from_pretrained(sys.argv[1])"  # fmt: skip
EMA_LOAD = "import sys; from diffusers import UNet2DConditionModel\n" \
    "from diffusers.training_utils import EMAModel\n" \
    "EMAModel.from_pretrained(sys.argv[1], model_cls=UNet2DConditionModel)"  # fmt: skip
PIPELINE_LOAD = "import sys; from diffusers import DiffusionPipeline\n" \
    "DiffusionPipeline.from_pretrained(sys.argv[1])"  # fmt: skip
TORCH_LOAD = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
EXPORT_LOAD = "import sys, torch; torch.export.load(sys.argv[1])"
YOLO_LOAD = "import sys; sys.path.append(sys.argv[2]); from ultralytics import YOLO\n" \
    "YOLO(sys.argv[1])"  # fmt: skip
# the aqt_* files load only with the torchao that wrote them (0.13), put first on the path
LEGACY_LOAD = "import sys; sys.path.insert(0, sys.argv[2]); import torch\n" \
    "torch.load(sys.argv[1], weights_only=False)"  # fmt: skip
# "large-read": every weight in hand and read (summed), as a first inference would read them
SUM = "print(sum(float(t.float().sum()) for t in state.values()))"
UNET_READ = "import sys; from diffusers import UNet2DConditionModel\n" \
    "state = UNet2DConditionModel.from_pretrained(sys.argv[1]).state_dict()\n" + SUM  # fmt: skip
ST_READ = "import sys; from sentence_transformers import SentenceTransformer\n" \
    "state = SentenceTransformer(sys.argv[1], device='cpu').state_dict()\n" + SUM  # fmt: skip
TOOL_READ = "import sys, ckpttool\nstate = ckpttool.load_state_dict(sys.argv[1])\n" + SUM


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def _show(path: Path) -> list[str]:
    return [sys.executable, "-m", "ckpttool", "show", str(path)]


def build_export(out: Path) -> Path:
    """A ``torch.export`` archive of a small MLP (conv, linear, a buffer), written once."""
    path = out / "library_layouts" / "mlp.pt2"
    if path.exists():
        return path
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.norm = torch.nn.BatchNorm2d(8)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.conv(x)).mean(dim=(2, 3)))

    torch.manual_seed(0)
    program = torch.export.export(Net().eval(), (torch.randn(1, 3, 8, 8),))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path.with_suffix(".tmp")))
    path.with_suffix(".tmp").rename(path)
    return path


def build_large_unet(out: Path) -> Path:
    """Stable Diffusion 1.x's UNet layout at 0.4x its channel widths, random init, fp32."""
    path = out / "library_layouts" / "unet_large"
    if (path / "config.json").exists():
        return path
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(128, 256, 512, 512), cross_attention_dim=768)
    unet.save_pretrained(str(path))
    return path


def build_large_sentence_transformer(out: Path) -> Path:
    """A sentence-transformer around a BERT-base-sized model (random init) with mean pooling."""
    import shutil
    import tempfile

    path = out / "library_layouts" / "st_bert_base"
    if (path / "modules.json").exists():
        return path
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp())
    try:
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
        (work / "vocab.txt").write_text("\n".join(vocab) + "\n")
        BertModel(BertConfig()).save_pretrained(work / "bert")  # BERT-base: 768 x 12 layers
        BertTokenizerFast(vocab_file=str(work / "vocab.txt")).save_pretrained(work / "bert")
        transformer = models.Transformer(str(work / "bert"))
        model = SentenceTransformer(modules=[transformer, models.Pooling(768)], device="cpu")
        model.save(str(path))
    finally:
        shutil.rmtree(work)
    return path


def _ultralytics_site(given: Path | None) -> str | None:
    if given is not None:
        return str(given)
    try:
        import ultralytics  # noqa: F401
    except ImportError:
        return None
    return ""


def pairs(
    group: str, out: Path, site: str | None, torchao_site: Path | None
) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (ckpttool show, the library's load) for ``group``."""
    folders = FIXTURES / "folders"
    # name -> (checkpoint, the load's code, its arguments after the checkpoint's path)
    rows: dict[str, tuple[Path, str, tuple[str, ...]]] = {}
    if group == "fixtures":
        rows["st_dense (SentenceTransformer)"] = (folders / "st_dense", ST_LOAD, ())
        for case in ("unet", "unet_bin", "unet_sharded"):
            rows[f"{case} (UNet2DConditionModel)"] = (folders / case, UNET_LOAD, ())
        rows["unet_ema (EMAModel)"] = (folders / "unet_ema", EMA_LOAD, ())
        rows["ldm_pipeline (DiffusionPipeline)"] = (folders / "ldm_pipeline", PIPELINE_LOAD, ())
    elif group == "pickles":
        if site is not None:
            for name in ("last.pt", "best.pt"):
                path = FIXTURES / "ultralytics" / name
                rows[f"ultralytics {name} (YOLO)"] = (path, YOLO_LOAD, (site,))
        rows["mmengine iter_2.pth"] = (FIXTURES / "mmengine" / "iter_2.pth", TORCH_LOAD, ())
        for path in sorted((FIXTURES / "torchao").glob("*.pt")):
            if not path.name.startswith("aqt_"):
                rows[f"torchao {path.name}"] = (path, TORCH_LOAD, ())
            elif torchao_site is not None:
                rows[f"torchao {path.name} (0.13)"] = (path, LEGACY_LOAD, (str(torchao_site),))
        for path in sorted((FIXTURES / "nanogpt").glob("*/ckpt.pt")):
            rows[f"nanoGPT {path.parent.name}/ckpt.pt"] = (path, TORCH_LOAD, ())
        rows["torch.export mlp.pt2"] = (build_export(out), EXPORT_LOAD, ())
    elif group == "large":
        rows["unet_large (UNet2DConditionModel)"] = (build_large_unet(out), UNET_LOAD, ())
        st = build_large_sentence_transformer(out)
        rows["st_bert_base (SentenceTransformer)"] = (st, ST_LOAD, ())
    elif group == "large-read":
        unet, st = build_large_unet(out), build_large_sentence_transformer(out)
        return {
            "unet_large (UNet2DConditionModel)": (
                _python(TOOL_READ, str(unet)),
                _python(UNET_READ, str(unet)),
            ),
            "st_bert_base (SentenceTransformer)": (
                _python(TOOL_READ, str(st)),
                _python(ST_READ, str(st)),
            ),
        }
    else:
        raise ValueError(group)
    return {
        name: (_show(path), _python(code, str(path), *extra))
        for name, (path, code, extra) in rows.items()
    }


FLOORS = {
    "python -c 'import torch'": _python("import torch"),
    "python -c 'import diffusers'": _python("import diffusers"),
    "python -c 'import sentence_transformers'": _python("import sentence_transformers"),
}


def _size(path: Path) -> str:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    return f"{total / 1e6:.1f} MB" if total >= 1e6 else f"{total / 1e3:.0f} kB"


def report(
    rows: dict[str, tuple[list[str], list[str]]],
    results: dict[str, Result],
    floors: bool,
    ours: str = "show",
) -> str:
    lines = [
        f"| checkpoint | size | {ours} wall (s) | load wall (s) | wall {ours}/load "
        f"| {ours} RSS (MB) | load RSS (MB) | RSS {ours}/load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (show, _) in rows.items():
        s, load = results[f"{name}: show"], results[f"{name}: load"]
        lines.append(
            f"| {name} | {_size(Path(show[-1]))} | {s.median_wall_s:.3f} "
            f"| {load.median_wall_s:.3f} | {s.median_wall_s / load.median_wall_s:.2f}x "
            f"| {s.median_peak_rss_mb:.1f} | {load.median_peak_rss_mb:.1f} "
            f"| {s.median_peak_rss_mb / load.median_peak_rss_mb:.2f}x |"
        )
    if floors:
        lines.append("")
        lines.append("| floor | median wall (s) | median peak RSS (MB) |")
        lines.append("|---|---:|---:|")
        for name in FLOORS:
            r = results[name]
            lines.append(f"| {name} | {r.median_wall_s:.3f} | {r.median_peak_rss_mb:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.library_layouts", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--group", choices=("fixtures", "pickles", "large", "large-read", "all"), default="all"
    )
    parser.add_argument("--no-floors", action="store_true", help="skip the import-only rows")
    parser.add_argument(
        "--ultralytics-site", type=Path, help="folder of a `pip install --target` of ultralytics"
    )
    parser.add_argument(
        "--torchao-0.13-site",
        dest="torchao_site",
        type=Path,
        help="folder of a `pip install --target` of torchao 0.13.0 (for the aqt_* files)",
    )
    args = parser.parse_args(argv)
    os.environ.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", YOLO_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    site = _ultralytics_site(args.ultralytics_site)
    groups = (
        ("fixtures", "pickles", "large", "large-read") if args.group == "all" else (args.group,)
    )
    for index, group in enumerate(groups):
        rows = pairs(group, args.out, site, args.torchao_site)
        commands: dict[str, list[str]] = {}
        for name, (show, load) in rows.items():
            commands[f"{name}: show"], commands[f"{name}: load"] = show, load
        floors = index == 0 and not args.no_floors
        if floors:
            commands.update(FLOORS)
        results = measure_all(commands, runs=args.runs, warmup=args.warmup)
        print(f"### {group} (median of {args.runs} runs)\n")
        ours = "load_state_dict" if group == "large-read" else "show"
        print(report(rows, results, floors, ours))
        if group == "pickles" and site is None:
            print("\n(ultralytics rows left out: not importable; see --ultralytics-site)")
        if group == "pickles" and args.torchao_site is None:
            print(
                "\n(torchao aqt_* rows left out: they need torchao 0.13; see --torchao-0.13-site)"
            )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
