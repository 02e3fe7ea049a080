"""Write torchao's Int4 fixture: a Linear stack quantized by ``Int4WeightOnlyConfig`` on CUDA.

torchao 0.18's ``Int4WeightOnlyConfig`` runs on no CPU: its default ``plain`` packing needs the
``mslk`` CUDA kernels, ``plain_int32`` an XPU or NPU, ``preshuffled`` mslk, and
``tile_packed_to_4d`` (tinygemm, ``Int4TilePackedTo4dTensor``) torch's CUDA op
``_convert_weight_to_int4pack`` on a GPU of compute capability 8 or more. This script writes
the ``tile_packed_to_4d`` one on such a GPU: a bfloat16 ``nn.Sequential(Linear(64, 32), ReLU(),
Linear(32, 8))`` (seed 0), ``quantize_(model, Int4WeightOnlyConfig(group_size=32,
int4_packing_format="tile_packed_to_4d"))``, moved to the CPU, then
``torch.save(model.state_dict())``.

No Int4 tensor of torchao 0.18 has a ``dequantize()``: torchao's own values of the weight are
what its linear gives, ``F.linear(I, w).t()`` (the tinygemm kernel ``_weight_int4pack_mm`` on
the identity: each output element is one weight times 1, so the bfloat16 result is the
kernel's dequantized weight; torchao's older ``TensorCoreTiledAQTTensorImpl.get_plain`` used the
same trick). ``int4_manifest.json`` freezes them per key beside what ``torch.load`` gives (class,
logical dtype and shape, block size, inner tensors); it goes into ``manifest.json`` under
``files``. ``int4_tile_probes.safetensors`` holds the packing of known integer grids, 8 x 1024
(``digitD``: each element the D-th hex digit of its index ``r * 1024 + c``), to check
ckpttool's reading of the tile layout against the op itself; ``int4_reference.pt`` the
dequantized weights (not committed: their sha256 is in the manifest).

Run on a CUDA machine, torchao 0.18.0 installed (the output folder: ``$OUT`` or ``--output``):

    python tools/torchao_int4_fixture.py --output DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import traceback
from pathlib import Path
from typing import Any

SEED = 0
GROUP_SIZE = 32
WIDTHS = (64, 32, 8)
INNER_K_TILES = 8  # torchao's Int4TilePackedTo4dTensor: fixed


def sha256(tensor: Any) -> str:
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def plain(tensor: Any) -> dict[str, Any]:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "sha256": sha256(tensor)}  # fmt: skip


def torchao_values(weight: Any) -> Any:
    """torchao's own values of a quantized weight: its linear on the identity, transposed."""
    import torch

    in_features = weight.shape[-1]
    eye = torch.eye(in_features, dtype=weight.dtype, device=weight.device)
    return torch.nn.functional.linear(eye, weight).t().contiguous()


def probes(rows: int = 8, columns: int = 1024) -> dict[str, Any]:
    """The packing of integer grids whose element (r, c) holds the D-th hex digit of
    ``r * columns + c`` (D = 0..3), by torchao's own two steps (pairs into bytes, then the op):
    one tile row, every tile column, lane, word and nibble."""
    import torch

    index = torch.arange(rows * columns, dtype=torch.int32, device="cuda").reshape(rows, columns)
    out = {}
    for digit in range(4):
        grid = (index >> (4 * digit)) & 15
        pairs = (grid[:, ::2] << 4 | grid[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
        out[f"digit{digit}"] = packed.cpu().contiguous()
    return out


def main() -> None:
    import torch
    import torchao
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    first, hidden, last = WIDTHS
    model = torch.nn.Sequential(
        torch.nn.Linear(first, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, last)
    )
    model = model.to(torch.bfloat16).cuda()
    config = Int4WeightOnlyConfig(group_size=GROUP_SIZE, int4_packing_format="tile_packed_to_4d")
    quantize_(model, config)
    on_cuda = model.state_dict()
    values = {k: torchao_values(v) for k, v in on_cuda.items() if type(v) is not torch.Tensor
              and type(v) is not torch.nn.Parameter}  # fmt: skip
    saved_from = "cpu"
    try:
        state = {k: v.to("cpu") for k, v in on_cuda.items()}
    except Exception:  # the subclass has no CPU copy: saved from CUDA (device tags "cuda")
        traceback.print_exc()
        state, saved_from = on_cuda, "cuda"
    path = args.output / "int4_tile_packed.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=False)
    described: dict[str, Any] = {}
    for key, value in loaded.items():
        if key not in values:
            described[key] = plain(value)
            continue
        cls = type(value)
        names, _ = value.__tensor_flatten__()
        described[key] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "block_size": list(value.block_size),
            "inner": {name: plain(getattr(value, name)) for name in names},
            "dequantize": plain(values[key]),
        }
    manifest = {"int4_tile_packed.pt": {
        "torchao": torchao.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "saved_from": saved_from,
        "config": "Int4WeightOnlyConfig", "packing_format": "tile_packed_to_4d",
        "group_size": GROUP_SIZE, "model_dtype": "bfloat16", "state_dict": described,
        "dequantize_by": "F.linear(torch.eye(K), weight).t() on CUDA (torchao's tinygemm linear)",
    }}  # fmt: skip
    (args.output / "int4_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    torch.save({k: v.cpu() for k, v in values.items()}, args.output / "int4_reference.pt")
    from safetensors.torch import save_file

    save_file(probes(), args.output / "int4_tile_probes.safetensors",
              metadata={"grid": "8x1024", "inner_k_tiles": str(INNER_K_TILES),
                        "torch": torch.__version__})  # fmt: skip
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
