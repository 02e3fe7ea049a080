"""What the safe unpickler allows: the data constructs it emulates and the names it refuses.

The policy is an allow-list: a call is *emulated* (never performed) only for the constructs
of :mod:`ckpttool.pickle.emulation` — torch's tensor rebuilders, ``OrderedDict``, NumPy
arrays/scalars/dtypes, ``argparse.Namespace``, a few builtins; anything else becomes an
:class:`~ckpttool.model.records.OpaqueObject`. The deny-list of
dangerous names only decides whether to refuse a file outright (and how ``scan`` classes a
global); safety never depends on it, since nothing named is ever imported or called.
"""

from __future__ import annotations

import _compat_pickle
from collections.abc import Iterable
from enum import Enum

from ckpttool.model.data_records import DISTRIBUTED_RECORDS as DISTRIBUTED_RECORDS
from ckpttool.model.data_records import is_data_record
from ckpttool.pickle.callables import torch_function
from ckpttool.pickle.emulation import is_emulated
from ckpttool.pickle.inert import inert_kind

__all__ = [
    "RENAMED_MODULES",
    "UNRESOLVED",
    "Verdict",
    "classify_global",
    "is_data_record",
    "never_load_problem",
    "python3_name",
]


class Verdict(str, Enum):
    """How a global a pickle names is classed (by :func:`classify_global`, shown by ``scan``).

    A ``str``: JSON output, tables and comparisons with ``"safe"`` see the value.
    """

    SAFE = "safe"  # a data construct the reader emulates, or a known data record
    UNKNOWN = "unknown"  # a config or model class: torch.load would import and call it
    DANGEROUS = "dangerous"  # its only use in a pickle is to run code or touch the system
    ALLOWED = "allowed"  # not a class: a name the user allowed (``scan --allow``)

    def __str__(self) -> str:  # "safe", not "Verdict.SAFE", wherever it is printed
        return self.value


# Modules (and builtins) whose only use in a checkpoint is to run code or touch the system.
_DANGEROUS_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "posixpath",
        "ntpath",
        "subprocess",
        "sys",
        "runpy",
        "importlib",
        "imp",
        "pty",
        "shutil",
        "socket",
        "pickle",
        "_pickle",
        "cPickle",
        "marshal",
        "ctypes",
        "code",
        "codeop",
        "pdb",
        "bdb",
        "pydoc",  # pydoc.pipepager(text, cmd) runs a shell: a known block-list bypass
        "webbrowser",
        "multiprocessing",
        "asyncio",
        "functools",
        "operator",
        "types",
        "inspect",
        "platform",
        "pip",
        "setuptools",
        "tempfile",
        "io",
        "_io",
        "signal",
        "threading",
        "_thread",
        "timeit",
        "trace",
        "cProfile",
        "profile",
        "doctest",
        "ensurepip",
        "venv",
        "sysconfig",
        "zipimport",
        "pkgutil",
        "site",
        "commands",
        "popen2",
        "urllib",
        "http",
        "ftplib",
        "telnetlib",
        "smtplib",
        "requests",
        "shelve",
        "dbm",
        "sqlite3",
        "glob",
        "fcntl",
        "resource",
        "gc",
        "weakref",
        "copy",
        "nturl2path",
        "_posixsubprocess",
        "_osx_support",
        "distutils",
        "xmlrpc",
        "logging",
        "unittest",
        # gadgets named in published scanner bypasses (picklescan advisories, modelscan #338)
        "_operator",
        "idlelib",
        "lib2to3",
        "ssl",
        "httplib",
        "aiohttp",
    }
)
_DANGEROUS_PREFIXES = (
    "torch.hub", "torch.jit", "torch._C", "torch.ops", "torch._dynamo",
    # a shell (collect_env.run), a profiler that runs a script, compilers and test helpers
    "torch.utils.collect_env", "torch.utils.bottleneck", "torch.utils.cpp_extension",
    "numpy.f2py", "numpy.testing", "numpy.distutils",
)  # fmt: skip
_DANGEROUS_NAMES = frozenset(
    {
        "builtins.eval",
        "builtins.exec",
        "builtins.compile",
        "builtins.open",
        "builtins.__import__",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.input",
        "builtins.breakpoint",
        "builtins.exit",
        "builtins.quit",
        "builtins.help",
        "builtins.memoryview",
        "builtins.type",
        "builtins.object",
        "builtins.super",
        "builtins.classmethod",
        "builtins.staticmethod",
        "builtins.property",
        "torch.load",
        "torch.serialization.load",
        "torch.save",
        "numpy.load",
        "numpy.save",
        "numpy.fromfile",
        "numpy.testing._private.utils.runstring",
        "numpy.lib.npyio.load",
        "numpy.f2py",
        "copyreg.__newobj_ex__",
    }
)
#: The module of the pseudo-global a walk records for what a static reading cannot resolve
#: (an ``EXT1`` code, a ``STACK_GLOBAL`` whose names are computed at load time, a call of an
#: object the pickle built): ``<unresolved>.EXT1 code 240``, always dangerous.
UNRESOLVED = "<unresolved>"
#: Attributes that reach a module's or a function's namespace: a dotted name through one
#: (``torch._utils.__builtins__.get``: protocol 4's ``find_class`` follows dots) is dangerous.
_NAMESPACE_ATTRIBUTES = frozenset(
    {"__builtins__", "__globals__", "__dict__", "__class__", "__subclasses__", "__base__",
     "__bases__", "__mro__", "__code__", "__closure__", "__func__", "__self__", "__module__",
     "__loader__", "__spec__", "__import__", "__getattribute__", "__reduce__", "__reduce_ex__",
     "__init_subclass__", "__call__", "__getattr__", "__setattr__", "__delattr__"}
)  # fmt: skip
#: py2 module names classed under their Python 3 names in every protocol (see ``python3_name``)
RENAMED_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg", "_compat_pickle": "pickle"}


def python3_name(module: str, name: str, protocol: int) -> tuple[str, str]:
    """The global Python 3 looks up for ``module.name`` in a pickle of ``protocol``.

    Python 3 writes a pickle of protocol 0 to 2 (``torch.save``'s default is 2) with Python 2's
    names, for Python 2 to read: ``int`` as ``__builtin__.long``, ``str`` as
    ``__builtin__.unicode``, ``range`` as ``__builtin__.xrange``. ``pickle.Unpickler.find_class``
    (``fix_imports=True``, the default, also torch.load's) maps them back when the protocol the
    pickle declared is below 3 (0 without a ``PROTO`` opcode): ``_compat_pickle.NAME_MAPPING``
    for the pair, else ``IMPORT_MAPPING`` for the module. The same is done here, so a name is
    classed as what Python would load. Past that, ``RENAMED_MODULES`` applies in every protocol:
    Python 3 would fail to import ``__builtin__`` in a protocol-3 pickle, but ``__builtin__.eval``
    is still classed as ``builtins.eval`` (refused), never as harmless.
    """
    if protocol < 3:
        renamed = _compat_pickle.NAME_MAPPING.get((module, name))
        if renamed is not None:
            module, name = renamed
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return RENAMED_MODULES.get(module, module), name


def _through_namespace(name: str) -> bool:
    """Whether a dotted name reaches through a namespace attribute. A module's own
    ``__dict__`` as the whole value (dill's encoding of a function's globals) is a name, not a
    path: what a file then does with it is a call, judged by its effect."""
    parts = name.split(".")
    if parts[-1] == "__dict__":
        parts = parts[:-1]
    return any(part in _NAMESPACE_ATTRIBUTES for part in parts)


def classify_global(module: str, name: str) -> Verdict:
    """SAFE (emulated data construct, known data record or inert global), DANGEROUS (code
    execution) or UNKNOWN, by the name alone: a *call* of an unknown global, or of a class
    :mod:`ckpttool.pickle.inert` knows only as data, is made dangerous by the walk
    (:meth:`ckpttool.pickle.interpreter.SafeUnpickler.call`)."""
    module = RENAMED_MODULES.get(module, module)
    qualname = f"{module}.{name}"
    if module == UNRESOLVED or _through_namespace(name):
        return Verdict.DANGEROUS
    if is_emulated(qualname):
        return Verdict.SAFE
    if is_data_record(qualname) or torch_function(qualname) is not None:
        return Verdict.SAFE
    if inert_kind(qualname) is not None:  # builtins.print among them: before the block-list
        return Verdict.SAFE
    root = module.split(".")[0]
    if (
        qualname in _DANGEROUS_NAMES
        # from protocol 4 find_class follows a dotted name: ("torch.serialization",
        # "os.system") is os.system, reached through a module that imports os (as ``os`` or
        # as a private alias, ``import os as _os``); a protocol-2 getattr chain is the same name
        or any(
            part.lstrip("_") in _DANGEROUS_MODULES or part.lstrip("_") == "builtins"
            for part in name.split(".")[:-1]
        )
        or root in _DANGEROUS_MODULES
        or module.startswith(_DANGEROUS_PREFIXES)
        or module == "builtins"  # every builtin the emulation does not know (eval, getattr...)
    ):
        return Verdict.DANGEROUS
    return Verdict.UNKNOWN


def never_load_problem(calls: str, names: Iterable[str]) -> str:
    """What ``verify`` reports when pickles call dangerous globals, the same advice for every
    format; ``calls`` begins the sentence ("the pickle calls", "the data files' pickles call")."""
    listed = ", ".join(sorted(names))
    return f"{calls} {listed}: never load it with torch.load (see `ckpttool scan`)"
