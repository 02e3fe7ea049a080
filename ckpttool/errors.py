"""The errors ckpttool raises.

Every error a user can cause with bad input is a :class:`CkptError`. The CLI prints its message
as one line (``Error: ...``) and exits with its ``exit_code``; nothing else reaches the user as
a traceback.
"""

from __future__ import annotations

import signal

#: Exit code for "the command could not do its job" (bad input, unreadable file, refused file).
EXIT_ERROR = 2
#: Exit code for "the command ran and found a difference or a problem" (diff, verify, scan).
EXIT_FOUND = 1
#: Exit code of a command stopped by Ctrl-C (SIGINT): 128 + 2, what a shell reports for a
#: program the signal killed, so scripts tell it from 1 (found) and 2 (error).
EXIT_INTERRUPTED = 130
#: Exit code when whatever read stdout went away (``ckpttool show ... | head``): 128 + 13,
#: what a shell reports for a program SIGPIPE killed (``cat``, ``git log``), in every output mode.
EXIT_PIPE_CLOSED = 141

#: What a message about a file cut short or torn adds: the command that salvages the rest.
CUT_HINT = " (cut short: ckpttool repair salvages what it still holds)"


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a ``timeout``, a ``kill``, a Slurm or Kubernetes preemption, a closed
    terminal), raised where Ctrl-C raises :class:`KeyboardInterrupt`: a subclass, so every
    cleanup that runs for Ctrl-C (temp files, staged directories, a created output directory)
    runs for it too. The command exits ``128 + signal`` (SIGTERM 143, SIGHUP 129)."""

    def __init__(self, signal_number: int, name: str) -> None:
        super().__init__(name)
        self.signal_number = signal_number
        self.name = name


#: The signals the CLI turns into :class:`Stopped` (:func:`ckpttool.cli.app.main`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Every signal that stops a command with its cleanup: what a write holds back in the instant
#: between making a temp file and recording it for removal (:mod:`ckpttool.io.atomic`).
CLEANUP_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)


class CkptError(Exception):
    """Base class of every error ckpttool raises on purpose."""

    exit_code = EXIT_ERROR


class InputError(CkptError):
    """The path given is not usable: missing, a directory, empty, unreadable."""


class MissingFileError(InputError, FileNotFoundError):
    """The path does not exist; a :class:`FileNotFoundError` too, so that a library caller's
    ``except FileNotFoundError`` (or ``OSError``) sees it."""


class UnreadableFileError(InputError, PermissionError):
    """The path exists but may not be read; a :class:`PermissionError` too."""


class EmptyFileError(InputError):
    """The file is there but holds no byte: a save that was interrupted (``verify``: a problem
    found, not a path it could not check)."""


class NotADirectoryCheckpointError(InputError):
    """A directory that is no checkpoint layout ckpttool knows (``verify``: it checks each
    checkpoint file in it, as ``scan`` does)."""


class NotACheckpointError(CkptError):
    """The file is readable but is not a checkpoint format ckpttool knows (or is TorchScript)."""


class CorruptCheckpointError(CkptError):
    """The file claims to be a checkpoint but its structure is broken (truncated, bad sizes...)."""


class UnsafePickleError(CkptError):
    """A pickle names a callable that could run code (``os.system``, ``builtins.eval``...).

    Nothing it names was imported or called; the file is refused.
    """


class AmbiguousFileError(CkptError):
    """The file reads two ways (a parser differential): ``torch.load`` and ckpttool, or two zip
    readers, or two formats, could see different contents. ``reason`` names both readings;
    every command but ``scan`` (which reports it as a finding) refuses the file."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"ambiguous file, refused: {reason}")
        self.reason = reason


class UnrecoverableError(CorruptCheckpointError):
    """A damaged file that nothing can be rebuilt from (a torch zip whose ``data.pkl`` is lost
    or unreadable): ``intact`` lists the records whose bytes still check out."""

    def __init__(self, message: str, intact: list[str] | None = None) -> None:
        super().__init__(message)
        self.intact = list(intact or [])


class ResourceLimitError(CkptError):
    """A pickle asks for more memory, nesting or time than any real checkpoint needs."""


class LayoutError(CkptError):
    """The checkpoint is readable but does not have the layout this operation needs."""


class OutputExistsError(CkptError):
    """The output path exists and the operation was not told to overwrite it."""


class CheckpointCollectionError(InputError):
    """The path holds several checkpoints (a Trainer ``output_dir``): name one of them.

    ``layout`` (a :class:`ckpttool.frameworks.base.FrameworkDirectory`) lists them, for ``show``;
    ``message`` describes them (``frameworks.describe_collection``).
    """

    def __init__(self, layout: object, message: str) -> None:
        super().__init__(message)
        self.layout = layout


class CheckpointKeyError(CkptError, KeyError):
    """A caller asked for a reserved or missing key (e.g. ``extra_state`` colliding with ``step``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TruncatedPickleError(CorruptCheckpointError):
    """The bytes end before the pickle does (or a length prefix points past them)."""


class AmbiguousPickleError(UnsafePickleError):
    """The pickle reads differently in torch.load than in a linear reader: a FRAME that does not
    end on an opcode (``ckpttool.pickle.frames``)."""


class SameKeyError(InputError):
    """Two paths of the tree flatten to the same dotted key (``{'a.b': {'c': t}}`` and
    ``{'a': {'b.c': t}}``): no prefix made them one, the file's own keys did."""

    def __init__(self, key: str) -> None:
        super().__init__(f"two paths flatten to the same key {key!r}")
        self.key = key


class ChangedError(InputError):
    """The remote file is not the one opened any more (size or ETag changed)."""


class NotZeroError(InputError):
    """The directory holds no partitioned ZeRO optimizer state (``deepspeed``: it is a
    DeepSpeed tag all the same, of ZeRO stage 0)."""

    def __init__(self, message: str, *, deepspeed: bool = False) -> None:
        super().__init__(message)
        self.deepspeed = deepspeed


class InexactRescaleError(InputError):
    """``strict`` was asked for and the new world size does not divide the batches consumed."""


class OverflowRefusedError(CkptError):
    """Casting would turn finite values into inf; refused unless ``allow_overflow``."""


class ReadBackError(CkptError):
    """What was written did not read back as intended (``convert``: not identical to the
    source; ``rescale-step``: not the file planned). It was removed and nothing was replaced:
    exit code 1, like a problem found."""

    exit_code = EXIT_FOUND


#: The names ``convert`` and ``rescale-step``'s rewrite raised it under before it was one error.
VerificationError = ReadBackError
RewriteCheckError = ReadBackError


def name_file(error: CkptError, path: str) -> CkptError:
    """``error`` with its message led by ``path`` (changed in place), unless it names it already.

    The format readers and the pickle walker do not know which file they read; the reader, the
    one place files are opened, adds it, so every message about a file says which file.
    """
    message = str(error)
    if path not in message:
        error.args = (f"{path}: {message}",)
    return error
