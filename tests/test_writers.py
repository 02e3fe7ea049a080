"""The safetensors header writer: its text is json.dumps of the header as one dict."""

from __future__ import annotations

import json
import struct

import pytest

from ckpttool.errors import InputError
from ckpttool.formats.base import OutTensor
from ckpttool.formats.safetensors_file import CODES, HEADER_ALIGNMENT, safetensors_header

# names JSON must escape, or that UTF-8 encodes in several bytes
NAMES = ["w", 'q"uote', "back\\slash", "new\nline", "nul\x00", "é", "\u2028sep", "𝔘nicode", ""]


def as_one_dict(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    """The header as the writer made it before it was built entry by entry."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-len(text)) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("metadata", [{}, {"format": "pt"}, {"é\n": 'v"al', "": "\\"}])
def test_header_is_the_json_of_one_dict(metadata: dict[str, str]) -> None:
    dtypes = sorted(CODES)
    tensors = [
        OutTensor(name, dtypes[i % len(dtypes)], tuple(range(i % 4)) or ((i,) if i % 2 else ()))
        for i, name in enumerate(NAMES)
    ]
    assert safetensors_header(tensors, metadata) == as_one_dict(tensors, metadata)
    assert safetensors_header([], metadata) == as_one_dict([], metadata)


def test_names_the_header_cannot_hold() -> None:
    one = OutTensor("w", "float32", (2,))
    with pytest.raises(InputError, match="'w' cannot be a tensor name"):
        safetensors_header([one, one], {})
    metadata_named = OutTensor("__metadata__", "float32", (2,))
    with pytest.raises(InputError, match="'__metadata__' cannot be a tensor name"):
        safetensors_header([metadata_named], {"format": "pt"})
    # without metadata there is no __metadata__ entry for it to clash with
    assert safetensors_header([metadata_named], {}) == as_one_dict([metadata_named], {})
