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


#: The torchao release whose AffineQuantizedTensor / LinearActivationQuantizedTensor files the
#: legacy fixtures are (0.18 no longer writes them: its ``version=1`` configs are removed).
LEGACY = "0.13.0"


def configs(version: str) -> dict[str, tuple[Any, str, tuple[int, ...]]]:
    """File name -> (torchao config, the float dtype of the model, its layer widths), for the
    installed torchao ``version``."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    if version == LEGACY:
        return {
            "aqt_int8_weight_only.pt": (Int8WeightOnlyConfig(), "float32", (16, 8, 4)),
            # torchao skips a layer this config would not speed up: the second stays float
            "aqt_int8_dynamic_int8_weight.pt": (
                Int8DynamicActivationInt8WeightConfig(), "float32", (32, 16, 8)
            ),
        }  # fmt: skip
    from torchao.quantization import Float8WeightOnlyConfig

    return {
        "int8_weight_only.pt": (Int8WeightOnlyConfig(), "float32", (16, 8, 4)),
        "int8_weight_only_bf16.pt": (Int8WeightOnlyConfig(), "bfloat16", (16, 8, 4)),
        "int8_dynamic_int8_weight.pt": (
            Int8DynamicActivationInt8WeightConfig(),
            "float32",
            (16, 8, 4),
        ),
        "float8_weight_only.pt": (Float8WeightOnlyConfig(), "float32", (16, 8, 4)),
    }


def write(path: Path, config: Any, dtype: str, widths: tuple[int, ...]) -> None:
    import torch
    from torchao.quantization import quantize_

    torch.manual_seed(SEED)
    first, hidden, last = widths
    model = torch.nn.Sequential(
        torch.nn.Linear(first, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, last)
    )
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


def inner_tensors(value: Any, prefix: str = "") -> dict[str, Any]:
    """A subclass's inner tensors by dotted name (``__tensor_flatten__``, down through the
    subclasses it wraps: AffineQuantizedTensor's ``tensor_impl.int_data``)."""
    import torch

    out = {}
    names, _ = value.__tensor_flatten__()
    for name in names:
        inner = getattr(value, name)
        if type(inner) is torch.Tensor:
            out[prefix + name] = inner
        else:
            out.update(inner_tensors(inner, f"{prefix}{name}."))
    return out


def dequantized(value: Any) -> Any:
    """torchao's own dequantize(); LinearActivationQuantizedTensor has none: its weight's."""
    weight = getattr(value, "original_weight_tensor", None)
    return (value if weight is None else weight).dequantize()


def describe(path: Path) -> dict[str, Any]:
    """What torchao's own load gives for each key of ``path``."""
    import torch

    out: dict[str, Any] = {}
    for key, value in torch.load(path, weights_only=False).items():
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
            out[key] = plain(value)
            continue
        cls = type(value)
        block = getattr(value, "block_size", None)
        if block is None:
            block = value.original_weight_tensor.block_size
        out[key] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "block_size": list(block),
            "inner": {name: plain(t) for name, t in inner_tensors(value).items()},
            "dequantize": plain(dequantized(value)),
        }
    return out


def main() -> None:
    import torch
    import torchao

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=FIXTURE)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    manifest_path = args.output / "manifest.json"
    # the files of the other torchao release stay as they are
    files = json.loads(manifest_path.read_text())["files"] if manifest_path.exists() else {}
    for name, (config, dtype, widths) in configs(torchao.__version__).items():
        write(args.output / name, config, dtype, widths)
        files[name] = {
            "torchao": torchao.__version__,
            "torch": torch.__version__,
            "config": type(config).__name__,
            "model_dtype": dtype,
            "state_dict": describe(args.output / name),
        }
    manifest = {"files": dict(sorted(files.items()))}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
