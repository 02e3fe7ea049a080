"""The names every ``--json`` output gives formats and layouts: one table of each.

``format`` says how the bytes are stored, ``layout`` what the object tree is (the keys of
:data:`~ckpttool.model.roles.LAYOUT_TITLES`, whose titles the text output prints). ``show``,
``diff``, ``convert``, ``rescale-step``, ``verify`` and ``scan`` all name a checkpoint from
these, and ``python -m tools.schema_enums`` writes them into docs/schemas/*.json (a test checks
the schemas are current).
"""

from __future__ import annotations

from ckpttool.model.roles import LAYOUT_TITLES

#: Every format a command reports for a checkpoint it read, with what it is.
FORMATS = {
    "torch-zip": "torch.save's zip archive (torch >= 1.6)",
    "torch-legacy": "torch.save's legacy stream of pickles (torch < 1.6)",
    "safetensors": "a safetensors file",
    "gguf": "a GGUF file (llama.cpp's model format, v2 or v3)",
    "pickle": "a bare pickle (no torch framing)",
    "dcp": "a torch.distributed.checkpoint directory",
    "directory": "a framework's directory of several files (Hugging Face, Trainer, accelerate, "
    "DeepSpeed)",
    "torchscript": "a TorchScript archive (scan only: never opened as a checkpoint)",
    "torch-tar": "torch's pre-0.4 tar format (scan only: its pickles are walked, never opened)",
    "torch-export": "a torch.export archive (.pt2): its weights and tensor constants, read by FQN",
    "torch-package": "a torch.package archive (scan only: never opened as a checkpoint)",
    "archive": "an archive wrapping files: gzip, bzip2, xz, tar (scan only: each file it holds is "
    "scanned), 7z, RAR, zstd (scan: not opened, a finding)",
}

#: Every layout a command reports.
LAYOUTS = tuple(LAYOUT_TITLES)
