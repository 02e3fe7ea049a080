"""Globals of popular libraries known to be inert in a pickle: ``scan`` classes them "safe".

Data, one entry a name (or a module prefix ending in ``.``), each with its kind and reason:

* ``CALL``: inert even when the pickle calls it (``REDUCE``): an enum's lookup by value
  (``IntervalStrategy('steps')``), ``datetime``'s constructors from their packed bytes,
  ``print`` kept as a logger (fastai's exported ``Learner``, skorch's net);
* ``CLASS``: inert when only named or built by pickle's default mechanism (``NEWOBJ`` or
  ``copyreg._reconstructor``, then ``BUILD`` of a plain ``__dict__`` or an inert
  ``__setstate__``): a dataclass such as ``TrainingArguments``, an ``nn.Module`` saved whole. A
  *call* of one with arguments runs its ``__init__`` or ``__post_init__`` and is judged as any
  other call (dangerous: :func:`ckpttool.pickle.policy.classify_global`, "Judged by effect").

Nothing here is imported: the names are matched as text. The tables are the one place this fact
lives (``docs/safety.md`` shows them); add an entry with its reason, never a whole library.
"""

from __future__ import annotations

CALL = "call"
CLASS = "class"

_ENUM = "an Enum: a call looks a member up by its value, nothing else runs"
_CONFIG = "a dataclass of settings: pickled as its fields, its __init__ never runs"
_OMEGA = "an OmegaConf container or node: pickled as its fields; __setstate__ only sets them"

#: Exact names: qualname -> (kind, reason).
INERT: dict[str, tuple[str, str]] = {
    # the standard library
    "datetime.datetime": (CALL, "rebuilt from its packed bytes: a value"),
    "datetime.date": (CALL, "rebuilt from its packed bytes: a value"),
    "datetime.time": (CALL, "rebuilt from its packed bytes: a value"),
    "datetime.timedelta": (CALL, "rebuilt from its numbers: a value"),
    "datetime.timezone": (CALL, "rebuilt from its offset and name: a value"),
    "builtins.print": (CALL, "kept as a logger (fastai, skorch): writes to stdout when called"),
    "builtins.complex": (CALL, "a number from its parts"),
    "builtins.slice": (CALL, "a slice from its bounds"),
    "builtins.range": (CALL, "a range from its bounds"),
    "decimal.Decimal": (CALL, "a number from its text"),
    "fractions.Fraction": (CALL, "a number from its text"),
    "uuid.UUID": (CLASS, "a value: its bytes as state"),
    "pathlib.PosixPath": (CALL, "a path from its parts: nothing on disk is touched"),
    "pathlib.WindowsPath": (CALL, "a path from its parts: nothing on disk is touched"),
    "pathlib.PurePosixPath": (CALL, "a path from its parts"),
    "pathlib.PureWindowsPath": (CALL, "a path from its parts"),
    "typing.Any": (CLASS, "a type annotation named as a value (OmegaConf's ref_type)"),
    "enum.Enum": (CLASS, "the enum base class, named"),
    # transformers' Trainer: training_args.bin
    "transformers.training_args.TrainingArguments": (CLASS, _CONFIG),
    "transformers.training_args_seq2seq.Seq2SeqTrainingArguments": (CLASS, _CONFIG),
    "transformers.trainer_pt_utils.AcceleratorConfig": (CLASS, _CONFIG),
    "transformers.training_args.OptimizerNames": (CALL, _ENUM),
    "transformers.training_args.ParallelMode": (CALL, _ENUM),
    "transformers.trainer_utils.IntervalStrategy": (CALL, _ENUM),
    "transformers.trainer_utils.SaveStrategy": (CALL, _ENUM),
    "transformers.trainer_utils.HubStrategy": (CALL, _ENUM),
    "transformers.trainer_utils.HPSearchBackend": (CALL, _ENUM),
    "transformers.trainer_utils.SchedulerType": (CALL, _ENUM),
    "transformers.trainer_utils.FSDPOption": (CALL, _ENUM),
    "transformers.trainer_utils.EvaluationStrategy": (CALL, _ENUM),
    "transformers.debug_utils.DebugOption": (CALL, _ENUM),
    # accelerate: the state and plug-ins TrainingArguments carries
    "accelerate.state.PartialState": (CLASS, "accelerate's process state: pickled as fields"),
    "accelerate.utils.dataclasses.DistributedType": (CALL, _ENUM),
    "accelerate.utils.dataclasses.DDPCommunicationHookType": (CALL, _ENUM),
    "accelerate.utils.dataclasses.SageMakerDistributedType": (CALL, _ENUM),
    "accelerate.utils.dataclasses.ComputeEnvironment": (CALL, _ENUM),
    "accelerate.utils.dataclasses.DynamoBackend": (CALL, _ENUM),
    "accelerate.utils.dataclasses.LoggerType": (CALL, _ENUM),
    "accelerate.utils.dataclasses.PrecisionType": (CALL, _ENUM),
    "accelerate.utils.dataclasses.RNGType": (CALL, _ENUM),
    "accelerate.utils.dataclasses.DataLoaderConfiguration": (CLASS, _CONFIG),
    "accelerate.utils.dataclasses.ProjectConfiguration": (CLASS, _CONFIG),
    "accelerate.utils.dataclasses.GradientAccumulationPlugin": (CLASS, _CONFIG),
    # OmegaConf (Hydra, Lightning's hparams)
    "omegaconf.dictconfig.DictConfig": (CLASS, _OMEGA),
    "omegaconf.listconfig.ListConfig": (CLASS, _OMEGA),
    "omegaconf.base.Metadata": (CLASS, _OMEGA),
    "omegaconf.base.ContainerMetadata": (CLASS, _OMEGA),
    "omegaconf.nodes.AnyNode": (CLASS, _OMEGA),
    "omegaconf.nodes.StringNode": (CLASS, _OMEGA),
    "omegaconf.nodes.IntegerNode": (CLASS, _OMEGA),
    "omegaconf.nodes.FloatNode": (CLASS, _OMEGA),
    "omegaconf.nodes.BooleanNode": (CLASS, _OMEGA),
    "omegaconf.nodes.EnumNode": (CLASS, _OMEGA),
    "omegaconf.nodes.PathNode": (CLASS, _OMEGA),
    "omegaconf.nodes.BytesNode": (CLASS, _OMEGA),
    # torchao's quantized tensors carry their settings as enums
    "torchao.quantization.quant_primitives.ZeroPointDomain": (CALL, _ENUM),
    "torchao.quantization.quant_primitives.MappingType": (CALL, _ENUM),
    "torchao.quantization.quant_primitives.TorchAODType": (CALL, _ENUM),
    "torchao.quantization.quantize_.common.kernel_preference.KernelPreference": (CALL, _ENUM),
    # peft's configs
    "peft.utils.peft_types.PeftType": (CALL, _ENUM),
    "peft.utils.peft_types.TaskType": (CALL, _ENUM),
    # Lightning
    "lightning_fabric.utilities.data.AttributeDict": (CLASS, "a dict of hyperparameters"),
    "pytorch_lightning.utilities.parsing.AttributeDict": (CLASS, "a dict of hyperparameters"),
    "lightning.fabric.utilities.data.AttributeDict": (CLASS, "a dict of hyperparameters"),
}

#: Module prefixes: every class below one, by the same rule (its kind and reason).
INERT_PREFIXES: dict[str, tuple[str, str]] = {
    "torch.nn.modules.": (
        CLASS,
        "torch's layers: an nn.Module saved whole is pickled as its fields; Module.__setstate__ "
        "only sets them",
    ),
    "torch.optim.": (
        CLASS,
        "torch's optimizers and schedulers, named in a factory (partial(torch.optim.Adam, ...)) "
        "or pickled as their fields",
    ),
}


def inert_kind(qualname: str) -> str | None:
    """``CALL``, ``CLASS`` or None (not known to be inert)."""
    entry = INERT.get(qualname)
    if entry is None:
        module = qualname.rpartition(".")[0] + "."
        entry = next((v for p, v in INERT_PREFIXES.items() if module.startswith(p)), None)
    return entry[0] if entry is not None else None


__all__ = ["CALL", "CLASS", "INERT", "INERT_PREFIXES", "inert_kind"]
