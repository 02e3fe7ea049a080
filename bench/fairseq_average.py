"""The baseline of ``bench.average``: fairseq's ``scripts/average_checkpoints.py`` algorithm,
written out here (fairseq itself is not installed; its script imports ``fairseq.file_io`` for
``PathManager.open`` only).

    python -m bench.fairseq_average --inputs A.pt B.pt ... --output OUT.pt

As fairseq does it: each input is loaded whole with ``torch.load`` (CPU), one after the other;
the first input's whole state is kept as the output's (its optimizer state included); each
tensor of ``state["model"]`` is summed into a dict of clones (fp16 widened to fp32 first; the
key lists must be equal and in the same order), every sum is divided in place by the number of
inputs, the output's ``model`` is replaced by those averages and the whole state is written with
``torch.save``. Peak memory is the first state, the sums and the state being loaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


def average_checkpoints(inputs: list[str]) -> dict[str, Any]:
    """fairseq's ``average_checkpoints(inputs)``: the first state with an averaged ``model``."""
    sums: dict[str, torch.Tensor] = {}
    keys: list[str] | None = None
    first: dict[str, Any] | None = None
    for path in inputs:
        state = torch.load(path, map_location="cpu")
        if first is None:
            first = state  # the settings (and everything else) come from the first checkpoint
        model = state["model"]
        if keys is None:
            keys = list(model)
        elif keys != list(model):
            raise KeyError(f"{path}: expected the parameters {keys}, found {list(model)}")
        for key in keys:
            value = model[key]
            if value.dtype == torch.float16:
                value = value.float()
            if key in sums:
                sums[key] += value
            else:
                sums[key] = value.clone()  # fairseq: the clone is needed for shared parameters
    assert first is not None
    for value in sums.values():
        if value.is_floating_point():
            value.div_(len(inputs))
        else:
            value //= len(inputs)
    first["model"] = sums
    return first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fairseq_average", description=__doc__)
    parser.add_argument("--inputs", required=True, nargs="+")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    torch.save(average_checkpoints(args.inputs), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
