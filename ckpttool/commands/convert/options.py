"""``convert``'s options as one value: what is written and how (:class:`ConversionOptions`).

Built once, by the command line from its flags or by :func:`ckpttool.commands.convert.run.convert`
from a library call's keywords, and handed down whole to the plan and the writer; which tensors
are converted, under which names, is the shared :class:`~ckpttool.commands.selection.Selection`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConversionOptions:
    """How ``convert`` writes: the output's format and dtype, what it may change, and checks."""

    to: str | None = None  # "safetensors" or "pth"; None: from DST's suffix
    dtype: str = "keep"  # "keep", "fp16", "bf16", "fp32": floating tensors cast to it
    allow_overflow: bool = False  # write values too large for ``dtype`` as inf
    keep_shared: bool = False  # tied tensors written as separate copies
    densify: bool = False  # sparse tensors stored as their dense values
    dequantize: bool = False  # quantized tensors stored as their float32 values
    skip_missing_values: bool = False  # leave out tensors the file holds no values of
    max_shard_size: str | int | None = None  # "2GB", bytes; None: one file
    verify: bool = True  # read the output back before it replaces anything
