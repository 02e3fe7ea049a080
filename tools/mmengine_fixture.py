"""Write ``tests/fixtures/mmengine/``: a checkpoint saved by mmengine's own ``Runner``.

A tiny ``BaseModel`` (a 2-layer MLP with a BatchNorm, whose running stats are buffers) trained
by ``Runner.train()`` for two iterations on CPU over a tiny in-memory dataset (dyadic inputs and
weights: the same bytes on every CPU up to SGD's rounding), with a ``MultiStepLR`` scheduler; the
``CheckpointHook`` saves ``iter_2.pth`` after the second iteration, as mmengine's
``Runner.save_checkpoint`` writes it: ``meta`` (``epoch``, ``iter``, ``seed``, ``cfg``,
``mmengine_version``...), ``state_dict``, ``message_hub`` (its ``HistoryBuffer`` objects pickle
``builtins.getattr(HistoryBuffer, 'min')``...), ``optimizer`` and ``param_schedulers``.

``manifest.json`` freezes what mmengine's own loader reads (``torch.load(weights_only=False)``:
mmengine 0.10.7's ``load_checkpoint`` calls ``torch.load`` without ``weights_only``, which torch
2.6+ takes as True, so it refuses its own checkpoints): the ``state_dict`` (key, dtype, shape,
sha256 of the bytes) and ``meta``'s ``epoch`` and ``iter``.
``tests/test_mmengine_fixture.py`` holds ckpttool to it and to mmengine's loader, live.

Run from the repository root with the pinned mmengine installed (the ``test`` extra):

    python -m tools.mmengine_fixture [--output DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mmengine"
SEED = 0
ITERS = 2


def _model() -> Any:
    from mmengine.model import BaseModel

    class TinyNet(BaseModel):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.head = nn.Linear(8, 2)

        def forward(self, inputs: torch.Tensor, targets: torch.Tensor, mode: str = "tensor") -> Any:
            out = self.head(self.backbone(inputs))
            if mode == "loss":
                return {"loss": ((out - targets) ** 2).mean()}
            return out

    model = TinyNet()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randint(-64, 65, param.shape, generator=generator).float() / 512)
    return model


class TinyDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Eight samples of dyadic inputs and targets, in memory."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(SEED + 1)
        self.inputs = torch.randint(-8, 9, (8, 4), generator=generator).float() / 8
        self.targets = torch.randint(-8, 9, (8, 2), generator=generator).float() / 8

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "targets": self.targets[index]}


def write(work_dir: Path) -> Path:
    """Run the Runner in ``work_dir``; the checkpoint it saved."""
    from mmengine.runner import Runner

    runner = Runner(
        model=_model(),
        work_dir=str(work_dir),
        train_dataloader={
            "dataset": TinyDataset(),
            "sampler": {"type": "DefaultSampler", "shuffle": False},
            "batch_size": 4,
            "num_workers": 0,
            "collate_fn": {"type": "default_collate"},
        },
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.125, "momentum": 0.5}},
        param_scheduler={"type": "MultiStepLR", "milestones": [1], "gamma": 0.5, "by_epoch": False},
        train_cfg={"by_epoch": False, "max_iters": ITERS},
        default_hooks={
            "checkpoint": {"type": "CheckpointHook", "interval": ITERS, "by_epoch": False},
            "logger": {"type": "LoggerHook", "interval": 1},
        },
        randomness={"seed": SEED, "deterministic": True},
        env_cfg={"dist_cfg": {"backend": "gloo"}},
        visualizer={"type": "Visualizer", "vis_backends": []},
        log_level="WARNING",
    )
    runner.train()
    return work_dir / f"iter_{ITERS}.pth"


def _sha256(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def manifest(path: Path) -> dict[str, Any]:
    """What mmengine's own loader sees in ``path``."""
    # mmengine 0.10.7's load_checkpoint calls torch.load without weights_only, which torch 2.6+
    # makes True: it refuses its own files (HistoryBuffer). What it would read is this:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return {
        "keys": list(checkpoint),
        "meta": {key: checkpoint["meta"][key] for key in ("epoch", "iter")},
        "state_dict": [
            {
                "key": key,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "sha256": _sha256(t),
            }
            for key, t in checkpoint["state_dict"].items()
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=FIXTURE)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mmengine_fixture_"))
    torch.set_num_threads(1)
    args.output = args.output.resolve()
    os.chdir(work)  # mmengine_version gets the git hash of the working directory: none here
    try:
        saved = write(work / "work_dir")
        args.output.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(saved, args.output / saved.name)
        text = json.dumps(manifest(args.output / saved.name), indent=1) + "\n"
        (args.output / "manifest.json").write_text(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
