"""``lora extract``: a LoRA adapter that turns BASE into (approximately) TUNED, by truncated SVD.

For each 2-D ``*.weight`` that differs between the two, the difference ``D = T - W`` (float32,
float64 kept) is factorised as ``U S V^T`` and cut to rank ``R``: ``lora_B = U_R sqrt(S_R)``
``[out, R]``, ``lora_A = sqrt(S_R) V_R^T`` ``[R, in]``, with ``lora_alpha = R`` so that PEFT's scale
``alpha / r`` is 1 (a matrix smaller than ``R`` gets its own rank in ``rank_pattern`` and
``alpha_pattern``). ``torch.linalg.svd`` for matrices up to :data:`FULL_SVD_MAX` on their short
side, ``torch.svd_lowrank`` above. Each tensor's report says the fraction of ``||D||^2`` the rank
keeps (1.0: the difference has rank <= R). An input embedding's difference is stored as PEFT's
``lora_embedding_A`` ``[R, vocab]`` / ``lora_embedding_B`` ``[dim, R]`` (``D = (B A)^T``).

A tensor that differs but is not a 2-D weight (a bias, a norm's scale) cannot be a LoRA: its
module goes to ``modules_to_save``, saved whole from TUNED (all of that module's tensors, and no
LoRA of it), unless ``strict``, which refuses it. The adapter directory (``adapter_config.json``,
``adapter_model.safetensors``) is what ``PeftModel.from_pretrained`` loads; it appears
all-or-nothing and is read back before it does. Its ``task_type`` is inferred from the base's
``config.json`` ``architectures`` (:data:`TASK_TYPES`), so that PEFT's ``AutoPeftModelFor...``
load it too, and ``base_model_name_or_path`` is the base's absolute path when the base is
local (they load the base from it, from whatever directory they are run in).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.convert import model_dir
from ckpttool.commands.convert.options import ConversionOptions
from ckpttool.commands.convert.plan import Plan, build_plan
from ckpttool.commands.selection import Selection
from ckpttool.errors import InputError, OutputExistsError, VerificationError
from ckpttool.formats.base import OutTensor
from ckpttool.formats.registry import format_by_id
from ckpttool.frameworks.base import DEFAULT_VIEW
from ckpttool.io.atomic import staged_directory
from ckpttool.io.values import dense_record, read_array
from ckpttool.model.cast import stored_dtype, widen
from ckpttool.model.records import TensorRecord

#: A full SVD up to this many rows or columns on the short side; a randomised one above.
FULL_SVD_MAX = 2048
FLOATS = ("float32", "float16", "bfloat16", "float64")
PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
#: PEFT's ``TaskType`` for a transformers class name ending so (``AutoPeftModelFor...`` loads
#: the base with the matching ``AutoModelFor...``); ``ForConditionalGeneration`` only for an
#: encoder-decoder config (``is_encoder_decoder``), the others (vision-language) have none.
TASK_TYPES = (
    ("ForCausalLM", "CAUSAL_LM"), ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"),
    ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"),
    ("ForQuestionAnswering", "QUESTION_ANS"), ("Model", "FEATURE_EXTRACTION"),
)  # fmt: skip
TASK_TYPE_NAMES = ("CAUSAL_LM", "SEQ_2_SEQ_LM", "SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS",
                   "FEATURE_EXTRACTION")  # fmt: skip
#: Input embeddings (PEFT wraps them as ``lora.Embedding``): names ending so.
EMBEDDING_ENDINGS = (
    "embed_tokens", "wte", "wpe", "word_embeddings", "embed_in", "tok_embeddings", "shared",
    "embed_positions", "position_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class Extracted:
    """One tensor's difference, as a LoRA of ``rank`` keeping ``energy`` of it."""

    name: str
    module: str
    shape: tuple[int, ...]
    rank: int
    energy: float  # sum of the kept squared singular values / ||difference||^2


@dataclass
class ExtractReport:
    base: str
    tuned: str
    output: Path
    rank: int
    extracted: list[Extracted]
    modules_to_save: list[str]  # modules saved whole (a differing bias or norm)
    unchanged: int  # tensors equal in both
    task_type: str | None = None  # adapter_config.json's (None: PeftModel only, a note says so)
    verified: bool = True
    notes: list[str] = field(default_factory=list)


def extract_adapter(
    base: str | os.PathLike[str],
    tuned: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    rank: int,
    strict: bool = False,
    force: bool = False,
    task_type: str | None = None,
) -> ExtractReport:
    """Write the PEFT adapter directory ``output`` that turns ``base`` into ``tuned`` at
    ``rank`` (see the module doc); ``task_type``: the config's (one of
    :data:`TASK_TYPE_NAMES`; None: inferred from the base's config). Raises
    :class:`InputError` (nothing written) for inputs whose tensors do not pair up, a non-2-D
    difference with ``strict``, or a bad rank."""
    if rank < 1:
        raise InputError(f"--rank must be at least 1; got {rank}")
    if task_type is not None and task_type not in TASK_TYPE_NAMES:
        raise InputError(
            f"--task-type must be one of {', '.join(TASK_TYPE_NAMES)}; got {task_type!r}"
        )
    target = Path(output)
    check_output(target, force)
    base_name, tuned_name = os.fspath(base), os.fspath(tuned)
    with (
        open_checkpoint(base, view=DEFAULT_VIEW) as a,
        open_checkpoint(tuned, view=DEFAULT_VIEW) as b,
    ):
        names_a, names_b = _weights(a), _weights(b)
        notes: list[str] = []
        if task_type is None:
            task_type = _task_type(a, base_name, notes)
        if sorted(names_a) != sorted(names_b):
            only = sorted(set(names_a) ^ set(names_b))
            side = base_name if only[0] in names_a else tuned_name
            raise InputError(
                f"{side}: holds {only[0]}, which the other does not "
                f"({len(only)} names differ); extract needs the same tensors in both"
            )
        changed: dict[str, TensorRecord | None] = {}
        unchanged = 0
        for name, record in names_a.items():
            other = names_b[name]
            if record.shape != other.shape:
                raise InputError(
                    f"{tuned_name}: {name} is {list(other.shape)}, {list(record.shape)} in the base"
                )
            if record.dtype not in FLOATS or other.dtype not in FLOATS:
                if not np.array_equal(_raw(a, record), _raw(b, other)):
                    changed[name] = None  # differs, but no LoRA of it: modules_to_save
                else:
                    unchanged += 1
                continue
            if np.array_equal(_floats(a, record), _floats(b, other)):
                unchanged += 1
            else:
                changed[name] = record
        saved_modules = _saved_modules(changed, strict, tuned_name)
        tensors: dict[str, np.ndarray] = {}
        extracted: list[Extracted] = []
        patterns: dict[str, int] = {}
        for name, differing in changed.items():
            module = name.rsplit(".", 1)[0]
            if module in saved_modules or differing is None:
                continue
            delta = _floats(b, names_b[name]) - _floats(a, differing)
            embedding = module.rsplit(".", 1)[-1] in EMBEDDING_ENDINGS
            low, high, energy = _factor(delta.T if embedding else delta, rank)
            kept = low.shape[1]
            if kept != rank:
                patterns[module] = kept
            suffix = ("lora_embedding_B", "lora_embedding_A") if embedding else (
                "lora_B.weight", "lora_A.weight")  # fmt: skip
            tensors[f"{PREFIX}{module}.{suffix[0]}"] = low
            tensors[f"{PREFIX}{module}.{suffix[1]}"] = high
            extracted.append(Extracted(name, module, tuple(differing.shape), kept, energy))
        for module in sorted(saved_modules):
            for name, record in names_b.items():
                if name.rsplit(".", 1)[0] == module:
                    tensors[PREFIX + name] = _floats(b, record) if record.dtype in FLOATS else (
                        np.ascontiguousarray(_raw(b, record)))  # fmt: skip
    if not extracted and not saved_modules:
        raise InputError(f"{tuned_name}: holds the same weights as {base_name}; nothing to extract")
    config = _config(rank, extracted, sorted(saved_modules), patterns, _base_path(base_name))
    config["task_type"] = task_type
    write_adapter(target, config, tensors, force)
    return ExtractReport(base_name, tuned_name, target, rank, extracted, sorted(saved_modules),
                         unchanged, task_type, notes=notes)  # fmt: skip


def _task_type(base: Checkpoint, name: str, notes: list[str]) -> str | None:
    """PEFT's task type for the base's ``config.json`` ``architectures`` (:data:`TASK_TYPES`),
    or None with a note saying what loads the adapter then."""
    config = base.root.get("config") if isinstance(base.root, dict) else None
    if not isinstance(config, dict):
        config = {}
    classes = config.get("architectures")
    found = set()
    for cls in classes if isinstance(classes, list) else []:
        if not isinstance(cls, str):
            continue
        if cls.endswith("ForConditionalGeneration") and config.get("is_encoder_decoder"):
            found.add("SEQ_2_SEQ_LM")
        found.update(task for ending, task in TASK_TYPES if cls.endswith(ending))
    if len(found) == 1:
        return found.pop()
    what = (f"its architectures {classes} give {len(found)} task types" if classes
            else "it has no config.json with architectures")  # fmt: skip
    notes.append(
        f"task_type not set ({name}: {what}): PeftModel.from_pretrained loads the adapter, "
        "AutoPeftModelFor... do not; pass --task-type to set it"
    )
    return None


def _base_path(base: str) -> str:
    """``base_model_name_or_path``: a local base as an absolute path (PEFT's Auto classes load
    the base from it, wherever they are run); a URL or hub name as given."""
    return str(Path(base).resolve()) if os.path.exists(base) else base


def check_output(target: Path, force: bool) -> None:
    """``target`` can become an adapter directory (empty, absent, or one to replace with
    ``force``), else :class:`InputError` / :class:`OutputExistsError`."""
    if target.exists() and not target.is_dir():
        raise InputError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not force:
            raise OutputExistsError(f"{target} exists and is not empty; pass --force to replace it")
        others = sorted(
            p.name for p in target.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME)
        )
        if others:
            raise InputError(
                f"{target}: holds files an adapter directory does not ({', '.join(others[:3])}); "
                "--force replaces only an adapter directory; name another OUT"
            )
    if not target.parent.is_dir():
        raise InputError(f"{target.parent}: no such directory for the output")


def _weights(ckpt: Checkpoint) -> dict[str, TensorRecord]:
    """The model's tensors by the names ``convert`` would write (a model directory's tied output
    embedding left out, as it is on disk)."""
    plan: Plan = build_plan(ckpt, Selection(None, (), False, None), ConversionOptions())
    directory = model_dir.model_directory(ckpt)
    if directory is not None:
        plan = model_dir.for_transformers(plan, directory)
    return {p.name: p.record for p in plan.stored}


def _raw(ckpt: Checkpoint, record: TensorRecord) -> np.ndarray:
    return np.asarray(read_array(ckpt, dense_record(ckpt, record)))


def _floats(ckpt: Checkpoint, record: TensorRecord) -> np.ndarray:
    values = np.ascontiguousarray(read_array(ckpt, dense_record(ckpt, record)))
    if values.dtype.byteorder == ">":
        values = values.astype(values.dtype.newbyteorder("<"))
    wide = widen(values.view(stored_dtype(record.dtype)), record.dtype)
    return np.asarray(wide, dtype=np.float64 if record.dtype == "float64" else np.float32).reshape(
        record.shape
    )


def _saved_modules(changed: dict[str, TensorRecord | None], strict: bool, tuned: str) -> set[str]:
    """Modules with a differing tensor that is not a 2-D float weight: saved whole."""
    modules = set()
    for name, record in changed.items():
        if record is not None and len(record.shape) == 2 and name.endswith(".weight"):
            continue
        if strict:
            shape = list(record.shape) if record is not None else "?"
            raise InputError(
                f"{tuned}: {name} ({shape}) differs but is not a 2-D weight, so no LoRA can "
                "hold it; without --strict its module is saved whole (modules_to_save)"
            )
        modules.add(name.rsplit(".", 1)[0] if "." in name else name)
    return modules


def _factor(delta: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, float]:
    """``(B, A, energy)``: ``B @ A`` is the best rank-``rank`` approximation of ``delta``."""
    import torch

    matrix = torch.from_numpy(np.ascontiguousarray(delta))
    total = float(torch.sum(matrix.double() ** 2))
    kept = min(rank, *matrix.shape)
    if min(matrix.shape) <= FULL_SVD_MAX:
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    else:
        u, s, v = torch.svd_lowrank(matrix, q=min(kept + 10, *matrix.shape), niter=4)
        vh = v.T
    u, s, vh = u[:, :kept], s[:kept], vh[:kept]
    root = torch.sqrt(s)
    energy = float(torch.sum(s.double() ** 2)) / total if total else 1.0
    low = (u * root).contiguous().numpy()
    high = (root[:, None] * vh).contiguous().numpy()
    return low, high, min(energy, 1.0)


def _config(
    rank: int,
    extracted: list[Extracted],
    saved: list[str],
    patterns: dict[str, int],
    base: str,
) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT's ``LoraConfig`` writes it (the fields a LoRA needs;
    PEFT fills the others with their defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": rank,
        "rank_pattern": {re.escape(module): r for module, r in patterns.items()},
        "alpha_pattern": {re.escape(module): r for module, r in patterns.items()},
        "target_modules": sorted({e.module for e in extracted}) or None,
        "modules_to_save": saved or None,
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter(
    target: Path,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    force: bool,
    metadata: dict[str, str] | None = None,
) -> None:
    """The adapter directory ``target`` (``adapter_config.json``, ``adapter_model.safetensors``
    of ``tensors`` with ``metadata`` beside PEFT's ``format``), all or nothing, its weights read
    back before it appears."""
    names = sorted(tensors)
    out = [OutTensor(n, "float32" if tensors[n].dtype == np.float32 else str(tensors[n].dtype),
                     tuple(tensors[n].shape)) for n in names]  # fmt: skip
    data = [np.ascontiguousarray(tensors[n]).reshape(-1).view(np.uint8).data for n in names]
    digests = {n: zlib.crc32(d) for n, d in zip(names, data)}
    with staged_directory(target, replace_existing=force) as staging:
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        with open(staging / WEIGHTS_NAME, "wb") as handle:
            format_by_id("safetensors").write(
                handle, out, data, names, {}, {**(metadata or {}), "format": "pt"}
            )
            handle.flush()
            os.fsync(handle.fileno())
        with open_checkpoint(staging / WEIGHTS_NAME) as written:
            found = {r.key: r for r in written.tensors()}
            wrong = [n for n in names if n not in found or _crc(written, found[n]) != digests[n]]
        if wrong or len(found) != len(names):
            raise VerificationError(f"{target}: {WEIGHTS_NAME} did not read back as written "
                                    f"({wrong[:1]}); nothing was written")  # fmt: skip


def _crc(written: Checkpoint, record: TensorRecord) -> int:
    data, first = written.read_bytes(record)
    start = first * record.itemsize
    return zlib.crc32(memoryview(data)[start : start + record.nbytes])
