"""Write ``tests/fixtures/torchao/``: state dicts of Linear stacks quantized by torchao itself.

A tiny ``nn.Sequential(Linear(16, 8), ReLU(), Linear(8, 4))`` (seed 0), quantized on the CPU by
``torchao.quantization.quantize_`` with each config that runs there, then
``torch.save(model.state_dict())``: the weights are torchao tensor subclasses (``Int8Tensor``,
``Float8Tensor``) that ``torch.save`` pickles as ``_rebuild_wrapper_subclass`` plus their inner
tensors. ``manifest.json`` freezes what torchao's own load gives (``torch.load(path,
weights_only=False)``): per key, a plain tensor's dtype, shape and sha256, or a subclass's class,
logical dtype and shape, block size, inner tensors (name, dtype, shape, sha256) and the sha256
of its ``dequantize()``. ``tests/test_torchao.py`` holds ckpttool to it.

Run from the repository root with the pinned torchao installed (the ``test`` extra):

    python -m tools.torchao_fixture [--output DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torchao"
SEED = 0


def configs() -> dict[str, tuple[Any, str]]:
    """File name -> (torchao config, the float dtype of the model it quantizes)."""
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )

    return {
        "int8_weight_only.pt": (Int8WeightOnlyConfig(), "float32"),
        "int8_weight_only_bf16.pt": (Int8WeightOnlyConfig(), "bfloat16"),
        "int8_dynamic_int8_weight.pt": (Int8DynamicActivationInt8WeightConfig(), "float32"),
        "float8_weight_only.pt": (Float8WeightOnlyConfig(), "float32"),
    }


def write(path: Path, config: Any, dtype: str) -> None:
    import torch
    from torchao.quantization import quantize_

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model = model.to(getattr(torch, dtype))
    quantize_(model, config)
    torch.save(model.state_dict(), path)


def sha256(tensor: Any) -> str:
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def plain(tensor: Any) -> dict[str, Any]:
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sha256": sha256(tensor),
    }


def describe(path: Path) -> dict[str, Any]:
    """What torchao's own load gives for each key of ``path``."""
    import torch

    out: dict[str, Any] = {}
    for key, value in torch.load(path, weights_only=False).items():
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            out[key] = plain(value)
            continue
        names, _ = value.__tensor_flatten__()
        cls = type(value)
        out[key] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "block_size": list(value.block_size),
            "inner": {name: plain(getattr(value, name)) for name in names},
            "dequantize": plain(value.dequantize()),
        }
    return out


def main() -> None:
    import torch
    import torchao

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=FIXTURE)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, (config, dtype) in configs().items():
        write(args.output / name, config, dtype)
        files[name] = {"config": type(config).__name__, "model_dtype": dtype}
        files[name]["state_dict"] = describe(args.output / name)
    manifest = {"torchao": torchao.__version__, "torch": torch.__version__, "files": files}
    (args.output / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
