"""Callables a checkpoint names as values: torch's own functions, ``partial`` and ``getattr`` of them.

Training configs store activations and initialisers (``act_fn=F.gelu``, ``init=nn.init.normal_``)
and optimizer factories (``functools.partial(torch.optim.AdamW, lr=3e-4)``). Pickled, those are
``torch._C._nn.gelu``, ``builtins.getattr(torch._C._VariableFunctionsClass, 'relu')`` (how
``torch.relu`` pickles), ``functools.partial(...)``: a block-list of ``torch._C``, ``builtins``
and ``functools`` calls them dangerous, which they are not when what they reach is certain.

* :data:`TORCH_FUNCTIONS` lists, with a reason each, the torch functions that only compute on
  the tensors they are given; named in one of :data:`FUNCTION_MODULES` they are "safe".
* ``getattr(NAMESPACE, 'name')`` with NAMESPACE one of :data:`GETATTR_NAMESPACES` and a constant
  name in :data:`TORCH_FUNCTIONS` is resolved statically to the function it names (reported
  as such); the ``getattr`` and the namespace are then "safe".
* ``getattr(CLASS, 'Name')`` with ``CLASS.Name`` a nested data record
  (:data:`~ckpttool.model.data_records.NESTED_RECORDS`: ``ShardedTensor.ProcessGroupState``)
  is resolved to that class by name; the ``getattr`` is then "safe".
* ``getattr(GLOBAL, 'name')`` with GLOBAL a global classed "unknown" (a class never imported,
  or what such a ``getattr`` resolved to), and a constant name that is a name lookup (an
  identifier without ``__``: never ``__class__``, ``__reduce__``, ``__globals__``, nor a private
  ``__secret`` or its mangled ``_Model__secret``) is resolved to the global ``GLOBAL.name``,
  classed as that global would be (:func:`lookup_name`). This is how pickle writes a nested qualname below protocol 4
  (``getattr(BasePolicy, '_dummy_schedule')``, a staticmethod: stable-baselines3's
  ``policy.save()``; mmengine's message hub's ``getattr(HistoryBuffer, 'min')``): the same name
  protocol 4 writes as one ``STACK_GLOBAL 'BasePolicy._dummy_schedule'``, not a call of
  anything; the ``getattr`` is then "safe". When ``GLOBAL.name`` would be dangerous
  (``pkg.os`` then ``system``: ``os.system``; ``pkg._os`` likewise) or GLOBAL is not unknown
  (``os``, ``builtins``, a torch loader; a safe data record's method, ``PosixPath.unlink``),
  the ``getattr`` stays dangerous.
* ``functools.partial(target, ...)`` is "safe" when its target is a global classed safe or a
  torch class of :data:`PARTIAL_TARGET_MODULES`; ``partial`` itself calls nothing when built.

Every use of such a global must be one of these for it to be safe (:class:`ContextualUses`):
a ``getattr`` or ``partial`` that reaches anything else, or a namespace used any other way,
keeps the verdict the block-list gives it (dangerous for ``torch._C``, ``builtins``,
``functools``). Nothing is imported or called; the resolution is by name only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpttool.model.data_records import NESTED_RECORDS
from ckpttool.model.records import GlobalRef

_ACTIVATION = "an activation: computes on the tensor it is given, touches nothing else"
_ARITHMETIC = "tensor arithmetic: computes on its tensor arguments only"
_LAYER = "a layer or loss function: computes on its tensor arguments only"
_INIT = "a weight initialiser: fills the tensor it is given with numbers"

#: Torch functions a pickle may name (as values: activations in configs), each with its reason.
TORCH_FUNCTIONS: dict[str, str] = {
    **dict.fromkeys(
        ("relu", "relu_", "relu6", "gelu", "silu", "mish", "tanh", "sigmoid", "softmax",
         "log_softmax", "softmin", "softplus", "softsign", "elu", "selu", "celu", "leaky_relu",
         "prelu", "rrelu", "glu", "hardtanh", "hardswish", "hardsigmoid", "hardshrink",
         "softshrink", "tanhshrink", "logsigmoid", "threshold"),
        _ACTIVATION,
    ),
    **dict.fromkeys(
        ("add", "sub", "mul", "div", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "pow",
         "square", "clamp", "matmul", "mean", "sum", "cos", "sin", "erf", "maximum", "minimum"),
        _ARITHMETIC,
    ),
    **dict.fromkeys(
        ("layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "normalize",
         "dropout", "linear", "embedding", "scaled_dot_product_attention", "cross_entropy",
         "mse_loss", "l1_loss", "nll_loss", "binary_cross_entropy_with_logits"),
        _LAYER,
    ),
    **dict.fromkeys(
        ("normal_", "uniform_", "constant_", "zeros_", "ones_", "eye_", "xavier_uniform_",
         "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
         "orthogonal_"),
        _INIT,
    ),
}  # fmt: skip

#: Modules that hold those functions under those names (a GLOBAL names ``module.function``).
FUNCTION_MODULES: dict[str, str] = {
    "torch": "torch's tensor functions (torch.relu, torch.add)",
    "torch.functional": "torch's Python-level tensor functions",
    "torch.nn.functional": "torch.nn.functional: activations, normalisation, losses",
    "torch._C._nn": "where F.gelu, F.silu... live: pickle names them by their C module",
    "torch._C._VariableFunctions": "torch's C tensor functions (torch.relu's home)",
    "torch.special": "torch.special: elementwise functions",
    "torch._C._special": "torch.special's C module",
    "torch.nn.init": "weight initialisers",
}

#: What ``getattr(namespace, name)`` resolves to, by the namespace's name (a method descriptor
#: or a builtin of a class pickles as ``getattr(class, name)``: ``torch.relu`` as
#: ``getattr(torch._C._VariableFunctionsClass, 'relu')``, ``torch.Tensor.add`` as
#: ``getattr(torch._C.TensorBase, 'add')``).
GETATTR_NAMESPACES: dict[str, str] = {
    "torch._C._VariableFunctionsClass": "torch",
    "torch._C._VariableFunctions": "torch",
    "torch._C.TensorBase": "torch.Tensor",
    "torch.Tensor": "torch.Tensor",
    **{module: module for module in FUNCTION_MODULES if module != "torch"},
}

#: Modules whose classes a ``functools.partial`` may wrap (configs store optimizer, scheduler
#: and layer factories): building the partial only stores the class, and calling it later
#: builds a torch object from numbers.
PARTIAL_TARGET_MODULES: dict[str, str] = {
    "torch.optim": "optimizers and learning-rate schedulers (partial(AdamW, lr=...))",
    "torch.nn.modules": "layer classes (partial(nn.LayerNorm, eps=...))",
}

PARTIAL = "functools.partial"
GETATTR = "builtins.getattr"


def torch_function(qualname: str) -> str | None:
    """The reason a global naming a torch function is safe, or None."""
    module, _, name = qualname.rpartition(".")
    if module in FUNCTION_MODULES or module == "torch.Tensor":
        return TORCH_FUNCTIONS.get(name)
    return None


def lookup_name(namespace: GlobalRef, name: Any) -> GlobalRef | None:
    """The global ``getattr(namespace, name)`` names, or None where it is no name lookup.

    ``name`` must be a constant identifier without ``__``: a dunder (``__globals__``,
    ``__class__``, ``__builtins__``, ``__subclasses__``) reaches the interpreter's machinery
    rather than a name the class defines, and a private name (``__secret``, mangled
    ``_Model__secret``) belongs to its class alone. One leading ``_`` is an ordinary name
    (stable-baselines3's ``BasePolicy._dummy_schedule``). The result is what protocol 4 writes
    as one dotted ``STACK_GLOBAL`` name, and is classed as such by the policy.
    """
    if not isinstance(name, str) or not name.isidentifier() or "__" in name:
        return None
    return GlobalRef(namespace.module, f"{namespace.name}.{name}")


def is_contextual(qualname: str) -> bool:
    """A global whose verdict depends on how the pickle uses it (:class:`ContextualUses`)."""
    return qualname in (PARTIAL, GETATTR) or qualname in GETATTR_NAMESPACES


class ContextualUses:
    """Verdicts of the contextual globals of one walk, settled by how each is used.

    ``seen`` is the walk's ``globals_seen`` list; ``safe`` and ``dangerous`` are the verdicts
    (``Verdict.SAFE``, ``Verdict.DANGEROUS``; each name's fallback is :func:`classify_global`'s).
    ``classify(module, name)`` is :func:`classify_global` (``unknown`` its third verdict): what
    ``getattr(GLOBAL, 'name')`` resolves to is classed by it.
    """

    def __init__(
        self,
        seen: list[tuple[str, str, Any]],
        safe: Any,
        dangerous: Any,
        unknown: Any = None,
        classify: Callable[[str, str], Any] | None = None,
    ) -> None:
        self.seen = seen
        self.safe = safe
        self.dangerous = dangerous
        self.unknown = unknown
        self.classify = classify
        # id(ref) -> [ref, its entry in ``seen``, fallback verdict, used well, used otherwise]
        self.refs: dict[int, list[Any]] = {}

    def named(self, ref: GlobalRef, fallback: Any) -> None:
        """A GLOBAL pushed ``ref`` (its entry is the last of ``seen``)."""
        self.refs[id(ref)] = [ref, len(self.seen) - 1, fallback, False, False]

    def _use(self, ref: Any, good: bool) -> None:
        entry = self.refs.get(id(ref))
        if entry is None or entry[0] is not ref:
            return
        if good:
            entry[3] = True
        else:
            entry[4] = True
        module, name, _ = self.seen[entry[1]]
        self.seen[entry[1]] = (module, name, self.safe if entry[3] and not entry[4] else entry[2])

    def call(self, func: GlobalRef, args: tuple[Any, ...], verdict_of: Any) -> GlobalRef | None:
        """Record a call of a contextual global; what ``getattr`` resolves to, if it does.

        ``verdict_of(qualname)`` classes a partial's target. Returns None for anything the
        general emulation should build (a partial, a refused getattr).
        """
        if id(func) not in self.refs:
            return None
        qualname = func.qualname
        if qualname == GETATTR:
            namespace = args[0] if len(args) == 2 else None
            name = args[1] if len(args) == 2 else None
            if (
                isinstance(namespace, GlobalRef)
                and isinstance(name, str)
                and NESTED_RECORDS.get(namespace.qualname) == name
            ):  # a data record's nested class (ShardedTensor.ProcessGroupState)
                self._use(func, True)
                nested = GlobalRef(namespace.module, f"{namespace.name}.{name}")
                self.seen.append((nested.module, nested.name, self.safe))
                return nested
            attribute = self._attribute(namespace, name)
            if attribute is not None:  # getattr(HistoryBuffer, 'min'): a name, looked up
                assert self.classify is not None
                self._use(func, True)
                verdict = self.classify(attribute.module, attribute.name)
                self.seen.append((attribute.module, attribute.name, verdict))
                return attribute
            home = (
                GETATTR_NAMESPACES.get(namespace.qualname)
                if isinstance(namespace, GlobalRef)
                else None
            )
            good = home is not None and isinstance(name, str) and name in TORCH_FUNCTIONS
            self._use(func, good)
            if home is None or not isinstance(name, str) or not good:
                return None
            self._use(namespace, True)
            self.seen.append((home, name, self.safe))
            return GlobalRef(home, name)
        if qualname == PARTIAL:
            target = args[0] if args else None
            good = isinstance(target, GlobalRef) and (
                verdict_of(target.qualname) == self.safe
                or target.module.startswith(tuple(f"{m}." for m in PARTIAL_TARGET_MODULES))
            )
            self._use(func, good)
            return None
        self._use(func, False)  # a namespace called directly
        return None

    def _attribute(self, namespace: Any, name: Any) -> GlobalRef | None:
        """``namespace.name`` as a global of its own (:func:`lookup_name`), when ``namespace``
        is a global classed unknown (a class the reader knows nothing of, or a name an earlier
        ``getattr`` resolved to) and the global it makes is not dangerous. The methods of a
        class classed safe (``pathlib.PosixPath.unlink``) are not what the allow-list vouches
        for, and :data:`GETATTR_NAMESPACES` are resolved above."""
        if (
            self.classify is None
            or not isinstance(namespace, GlobalRef)
            or namespace.qualname in GETATTR_NAMESPACES
            or self.classify(namespace.module, namespace.name) != self.unknown
        ):
            return None
        attribute = lookup_name(namespace, name)
        if attribute is None or self.classify(attribute.module, attribute.name) == self.dangerous:
            return None
        return attribute

    def refused(self, ref: Any) -> bool:
        """Whether ``ref`` has been used in a way that leaves it dangerous."""
        entry = self.refs.get(id(ref))
        return entry is not None and entry[4] and entry[2] == self.dangerous

    def unsafe(self) -> list[str]:
        """Names whose verdict, the walk done, is still dangerous (unused, or misused)."""
        return [
            f"{self.seen[i][0]}.{self.seen[i][1]}"
            for _, i, fallback, good, bad in self.refs.values()
            if (bad or not good) and fallback == self.dangerous
        ]


__all__ = [
    "FUNCTION_MODULES",
    "GETATTR_NAMESPACES",
    "PARTIAL_TARGET_MODULES",
    "TORCH_FUNCTIONS",
    "ContextualUses",
    "is_contextual",
    "lookup_name",
    "torch_function",
]
