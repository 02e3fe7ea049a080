"""The one dtype table: one row per torch dtype, with every fact a format or a command needs.

Each row gives the torch name (without ``torch.``), the bytes per stored element (per stored
byte for a packed dtype, with how many elements a byte holds), torch's typed storage class
(what a torch pickle names; ``torch.storage._dtype_to_storage_type_map``), the safetensors code
and the NumPy type code (no byte order) where those formats have one; GGUF's block-quantized
types are rows too (``torch=False``; a block's bytes in ``itemsize``, its elements in
``per_byte``). Every other table is derived from it: :data:`ITEMSIZE` and
:data:`ELEMENTS_PER_BYTE` (re-exported by :mod:`ckpttool.model.records`), :data:`STORAGE_DTYPES` (read) and :data:`STORAGE_CLASSES`
(written), :data:`SAFETENSORS_DTYPES`/:data:`SAFETENSORS_CODES`, :data:`NUMPY_DTYPES`/
:data:`NUMPY_CODES`. A new dtype is one row.
"""

from __future__ import annotations

from typing import NamedTuple


class Dtype(NamedTuple):
    name: str  # torch's name without "torch." ("float32")
    itemsize: int  # bytes per element (per stored byte for a packed dtype)
    storage: str | None = None  # torch's typed storage class ("FloatStorage")
    safetensors: str | None = None  # the safetensors code ("F32")
    numpy: str | None = None  # the NumPy type code without byte order ("f4"), a native type
    # elements per stored item of ``itemsize`` bytes (packed: a quint4x2 byte holds two; a GGML
    # block type: one block of ``itemsize`` bytes holds ``per_byte`` elements)
    per_byte: int = 1
    struct: str | None = None  # the struct module's code for one element ("f"), for NumPy scalars
    torch: bool = True  # a torch dtype (``torch.<name>``); GGUF's block types are not


def _ggml(name: str, block: int, nbytes: int) -> Dtype:
    """A GGML block type of GGUF files: ``block`` elements in ``nbytes`` bytes (ggml's
    ``GGML_QUANT_SIZES``), named as llama.cpp names it. Its scales are inside each block: the
    GGUF format decodes it (:mod:`ckpttool.formats.gguf`)."""
    return Dtype(name, nbytes, per_byte=block, torch=False)


#: Every dtype a checkpoint may name, in the order the tables list them.
DTYPES: tuple[Dtype, ...] = (
    Dtype("float64", 8, "DoubleStorage", "F64", "f8", struct="d"),
    Dtype("float32", 4, "FloatStorage", "F32", "f4", struct="f"),
    Dtype("float16", 2, "HalfStorage", "F16", "f2", struct="e"),
    Dtype("bfloat16", 2, "BFloat16Storage", "BF16"),
    Dtype("complex128", 16, "ComplexDoubleStorage", "C128", "c16"),
    Dtype("complex64", 8, "ComplexFloatStorage", "C64", "c8"),
    Dtype("complex32", 4),
    Dtype("int64", 8, "LongStorage", "I64", "i8", struct="q"),
    Dtype("int32", 4, "IntStorage", "I32", "i4", struct="i"),
    Dtype("int16", 2, "ShortStorage", "I16", "i2", struct="h"),
    Dtype("int8", 1, "CharStorage", "I8", "i1", struct="b"),
    Dtype("uint64", 8, None, "U64", "u8", struct="Q"),
    Dtype("uint32", 4, None, "U32", "u4", struct="I"),
    Dtype("uint16", 2, None, "U16", "u2", struct="H"),
    Dtype("uint8", 1, "ByteStorage", "U8", "u1", struct="B"),
    Dtype("bool", 1, "BoolStorage", "BOOL", "b1", struct="?"),
    Dtype("float8_e4m3fn", 1, None, "F8_E4M3"),
    Dtype("float8_e5m2", 1, None, "F8_E5M2"),
    Dtype("float8_e4m3fnuz", 1),
    Dtype("float8_e5m2fnuz", 1),
    Dtype("float8_e8m0fnu", 1, None, "F8_E8M0"),
    Dtype("float4_e2m1fn_x2", 1),
    Dtype("qint8", 1, "QInt8Storage"),
    Dtype("quint8", 1, "QUInt8Storage"),
    Dtype("qint32", 4, "QInt32Storage"),
    Dtype("quint4x2", 1, "QUInt4x2Storage", per_byte=2),
    Dtype("quint2x4", 1, "QUInt2x4Storage", per_byte=4),
    Dtype("bits8", 1),
    Dtype("bits16", 2),
    Dtype("bits1x8", 1),
    Dtype("bits2x4", 1),
    Dtype("bits4x2", 1),
    # sub-byte integers: torch stores each element in one byte (no packing)
    *(Dtype(f"{sign}int{bits}", 1) for sign in ("", "u") for bits in range(1, 8)),
    # GGUF's block-quantized types (ggml's GGML_QUANT_SIZES: QK_K = 256)
    _ggml("Q4_0", 32, 18), _ggml("Q4_1", 32, 20), _ggml("Q5_0", 32, 22), _ggml("Q5_1", 32, 24),
    _ggml("Q8_0", 32, 34), _ggml("Q8_1", 32, 40), _ggml("Q2_K", 256, 84), _ggml("Q3_K", 256, 110),
    _ggml("Q4_K", 256, 144), _ggml("Q5_K", 256, 176), _ggml("Q6_K", 256, 210),
    _ggml("Q8_K", 256, 292), _ggml("IQ2_XXS", 256, 66), _ggml("IQ2_XS", 256, 74),
    _ggml("IQ3_XXS", 256, 98), _ggml("IQ1_S", 256, 50), _ggml("IQ4_NL", 32, 18),
    _ggml("IQ3_S", 256, 110), _ggml("IQ2_S", 256, 82), _ggml("IQ4_XS", 256, 136),
    _ggml("IQ1_M", 256, 56), _ggml("TQ1_0", 256, 54), _ggml("TQ2_0", 256, 66),
    _ggml("MXFP4", 32, 17), _ggml("NVFP4", 64, 36), _ggml("Q1_0", 128, 18),
)  # fmt: skip

BY_NAME = {d.name: d for d in DTYPES}
#: The dtypes torch has (what a pickle's ``torch.<name>`` may name).
TORCH_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES if d.torch)

#: Bytes per element, by torch dtype name (without ``torch.``).
ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in DTYPES}
#: Packed dtypes: elements per stored byte (a quint4x2 storage holds ceil(numel / 2) bytes).
ELEMENTS_PER_BYTE: dict[str, int] = {d.name: d.per_byte for d in DTYPES if d.per_byte != 1}
#: Floating dtypes (NaN/Inf are looked for in them).
FLOATING_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16"} | {d for d in ITEMSIZE if d.startswith("float8")}
)

#: torch's typed storage class -> dtype (what a pickle's storage type names); an
#: ``UntypedStorage`` is bytes.
STORAGE_DTYPES: dict[str, str] = {
    **{d.storage: d.name for d in DTYPES if d.storage is not None},
    "UntypedStorage": "uint8",
}
#: dtype -> the typed storage class torch.save writes for it; the others (uint16, float8...,
#: and the quantized ones, which a state dict of plain tensors never holds) are saved by torch
#: as an UntypedStorage plus the dtype.
STORAGE_CLASSES: dict[str, str] = {
    d.name: d.storage for d in DTYPES if d.storage is not None and not d.name.startswith("q")
}

#: safetensors code -> dtype, and back.
SAFETENSORS_DTYPES: dict[str, str] = {d.safetensors: d.name for d in DTYPES if d.safetensors}
SAFETENSORS_CODES: dict[str, str] = {name: code for code, name in SAFETENSORS_DTYPES.items()}

#: NumPy type code (no byte order) -> dtype, and back (the dtypes NumPy has natively).
NUMPY_DTYPES: dict[str, str] = {d.numpy: d.name for d in DTYPES if d.numpy}
NUMPY_CODES: dict[str, str] = {name: code for code, name in NUMPY_DTYPES.items()}
#: NumPy type code -> the struct module's code for one element (a NumPy scalar's bytes).
STRUCT_CODES: dict[str, str] = {d.numpy: d.struct for d in DTYPES if d.numpy and d.struct}

#: The dtypes ``convert --dtype`` reads and writes (float8 & co. are left as they are); here,
#: not in :mod:`ckpttool.model.cast`, so that planning a conversion does not import NumPy.
CASTABLE = frozenset({"float16", "bfloat16", "float32", "float64"})
#: ``--dtype`` spellings and the torch dtype names they mean.
TARGETS = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


__all__ = [
    "BY_NAME",
    "CASTABLE",
    "DTYPES",
    "ELEMENTS_PER_BYTE",
    "FLOATING_DTYPES",
    "ITEMSIZE",
    "NUMPY_CODES",
    "NUMPY_DTYPES",
    "SAFETENSORS_CODES",
    "SAFETENSORS_DTYPES",
    "STORAGE_CLASSES",
    "STORAGE_DTYPES",
    "STRUCT_CODES",
    "TARGETS",
    "TORCH_DTYPES",
    "Dtype",
    "underflow_note",
]


def underflow_note(target: str, underflow: dict[str, int]) -> str:
    """The note ``convert --dtype`` and ``edit --dtype`` give for values a cast made zero:
    ``underflow`` is each tensor's count (non-zero values that became 0 in ``target``)."""
    shown = ", ".join(f"{name} ({count:,})" for name, count in list(underflow.items())[:5])
    more = f" (+{len(underflow) - 5} more tensors)" if len(underflow) > 5 else ""
    return f"values that became 0 in {target} (underflow): {shown}{more}"
