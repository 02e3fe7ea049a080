"""Write ``tests/fixtures/ultralytics/``: checkpoints saved by ultralytics' own trainer code.

A yolov8n-shaped ``DetectionModel`` built from ultralytics' ``yolov8n.yaml`` (no weight
download), shrunk to stay small (width 1/32, ``reg_max`` 4, 2 classes: 355 state-dict entries,
61k parameters), with dyadic weights; one SGD step (ultralytics' ``build_optimizer``) on a dyadic
surrogate gradient and one ``ModelEMA`` update. Then ``BaseTrainer.save_model`` itself writes
``last.pt`` (``{'epoch', 'best_fitness', 'model': None, 'ema': DetectionModel (fp16), 'updates',
'optimizer', 'scaler', 'train_args', ...}``) and ``strip_optimizer`` makes ``best.pt`` from it
(``model`` the EMA module, the optimizer gone), as a finished run leaves them. ``manifest.json``
freezes each file's module state dicts as ultralytics' own ``torch_load`` gives them (name,
dtype, shape, sha256 of the bytes): ``tests/test_ultralytics_fixture.py`` holds ckpttool to it.

Run from the repository root with the pinned ultralytics importable (README.md there):

    python -m tools.ultralytics_fixture [--output DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "ultralytics"
WIDTH = 1 / 32  # yolov8n's own is 0.25: this keeps every file under 300 kB
REG_MAX = 4  # DFL bins (16 by default: the head's 64-channel convs would dominate)
CLASSES = 2
SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=FIXTURE)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ultralytics_fixture_"))
    os.environ["YOLO_OFFLINE"] = "1"  # never the network (settings sync, font or asset fetches)
    os.environ["YOLO_CONFIG_DIR"] = str(work / "config")
    os.chdir(work)  # save_model records the git state of the working directory: none here
    try:
        write(work / "weights")
        args.output.mkdir(parents=True, exist_ok=True)
        for name in ("last.pt", "best.pt"):
            shutil.copyfile(work / "weights" / name, args.output / name)
        manifest = deduplicated(
            {name: describe(args.output / name) for name in ("last.pt", "best.pt")}
        )
        (args.output / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write(weights: Path) -> None:
    import torch
    from ultralytics import __version__
    from ultralytics.cfg import get_cfg
    from ultralytics.engine.trainer import BaseTrainer
    from ultralytics.nn.tasks import DetectionModel, yaml_model_load
    from ultralytics.utils.torch_utils import EarlyStopping, ModelEMA, strip_optimizer

    torch.manual_seed(SEED)
    config = yaml_model_load("yolov8n.yaml")
    config["scales"] = {"n": [0.33, WIDTH, 1024]}
    config["reg_max"] = REG_MAX
    model = DetectionModel(config, nc=CLASSES, verbose=False)
    dyadic(model)
    optimizer = BaseTrainer.build_optimizer(
        None,
        model,
        name="SGD",
        lr=0.01,
        momentum=0.937,
        decay=5e-4,
    )
    generator = torch.Generator().manual_seed(SEED + 1)
    for param in model.parameters():
        if param.requires_grad:  # the DFL's fixed conv is not trained
            param.grad = torch.randint(-8, 9, param.shape, generator=generator) / 256
    optimizer.step()
    ema = ModelEMA(model)
    ema.update(model)
    trainer_args = get_cfg(overrides={"model": "yolov8n.yaml", "data": "coco8.yaml", "epochs": 3})
    trainer_args.optimizer = "SGD"
    trainer = SimpleNamespace(
        ema=ema, model=model, epoch=0, best_fitness=0.25, fitness=0.25,
        stopper=EarlyStopping(patience=100), optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu", enabled=False), args=trainer_args,
        metrics={"metrics/mAP50(B)": 0.5}, read_results_csv=lambda: {"epoch": [1]},
        wdir=weights, last=weights / "last.pt", best=weights / "best.pt", save_period=-1,
    )  # fmt: skip
    BaseTrainer.save_model(trainer)
    assert __version__ == "8.4.190", __version__
    strip_optimizer(weights / "best.pt")


def dyadic(model: Any) -> None:
    """Every parameter and float buffer as k / 512 from integer draws (BatchNorm variances
    1 + k / 512): torch's ``uniform_`` gives different bits on different vector units."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or (
                not tensor.requires_grad and "running" not in name
            ):
                continue
            draws = torch.randint(-32, 33, tensor.shape, generator=generator).to(tensor.dtype)
            tensor.copy_(draws / 512 + (1.0 if name.endswith("running_var") else 0.0))


def describe(path: Path) -> dict[str, Any]:
    """What ultralytics' own loader gives: each module's ``state_dict()`` by part, and the
    file's other top-level keys."""
    from ultralytics.utils.patches import torch_load

    checkpoint = torch_load(path, map_location="cpu", weights_only=False)
    modules = {}
    for part, value in checkpoint.items():
        if hasattr(value, "state_dict") and hasattr(value, "named_modules"):
            modules[part] = {
                "class": f"{type(value).__module__}.{type(value).__qualname__}",
                "attribute_tensors": sorted(attribute_tensors(value)),
                "state_dict": [tensor_entry(key, t) for key, t in value.state_dict().items()],
            }
    return {"keys": list(checkpoint), "modules": modules}


def deduplicated(files: dict[str, Any]) -> dict[str, Any]:
    """``{"files": ..., "state_dicts": ...}``: each distinct state dict once, by the first
    ``FILE:PART`` that holds it (``best.pt``'s model is ``last.pt``'s EMA, as
    ``strip_optimizer`` makes it); the modules name theirs under ``state_dict``."""
    state_dicts: dict[str, Any] = {}
    for name, described in files.items():
        for part, module in described["modules"].items():
            entries = module["state_dict"]
            same = next((ref for ref, known in state_dicts.items() if known == entries), None)
            if same is None:
                same = f"{name}:{part}"
                state_dicts[same] = entries
            module["state_dict"] = same
    return {"files": files, "state_dicts": state_dicts}


def attribute_tensors(model: Any) -> list[str]:
    """Tensors a module holds outside its state dict (``stride``, a head's ``anchors``)."""
    import torch

    found = []
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not name.startswith("_"):
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


def tensor_entry(key: str, tensor: Any) -> dict[str, Any]:
    data = tensor.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
    return {
        "key": key,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


if __name__ == "__main__":
    main()
