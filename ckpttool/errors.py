"""The errors ckpttool raises.

Every error a user can cause with bad input is a :class:`CkptError`. The CLI prints its message
as one line (``Error: ...``) and exits with its ``exit_code``; nothing else reaches the user as
a traceback.
"""

from __future__ import annotations

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


class CkptError(Exception):
    """Base class of every error ckpttool raises on purpose."""

    exit_code = EXIT_ERROR


class InputError(CkptError):
    """The path given is not usable: missing, a directory, empty, unreadable."""


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


class ResourceLimitError(CkptError):
    """A pickle asks for more memory, nesting or time than any real checkpoint needs."""


class LayoutError(CkptError):
    """The checkpoint is readable but does not have the layout this operation needs."""


class OutputExistsError(CkptError):
    """The output path exists and the operation was not told to overwrite it."""


class CheckpointCollectionError(InputError):
    """The path holds several checkpoints (a Trainer ``output_dir``): name one of them.

    ``layout`` (a :class:`ckpttool.frameworks.DirectoryLayout`) lists them, for ``show``.
    """

    def __init__(self, layout: object) -> None:
        from ckpttool.frameworks import describe_collection

        super().__init__(describe_collection(layout))
        self.layout = layout


class CheckpointKeyError(CkptError, KeyError):
    """A caller asked for a reserved or missing key (e.g. ``extra_state`` colliding with ``step``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def name_file(error: CkptError, path: str) -> CkptError:
    """``error`` with its message led by ``path`` (changed in place), unless it names it already.

    The format readers and the pickle walker do not know which file they read; the reader, the
    one place files are opened, adds it, so every message about a file says which file.
    """
    message = str(error)
    if path not in message:
        error.args = (f"{path}: {message}",)
    return error
