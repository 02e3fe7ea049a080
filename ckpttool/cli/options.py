"""The options several commands share, declared once so that each has one wording everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def json_option(schema: str) -> Callable[[F], F]:
    """``--json``: print the report as one JSON object, whose schema is
    ``docs/schemas/<schema>.schema.json``."""
    return click.option(
        "--json", "as_json", is_flag=True,
        help=f"Print one JSON object (schema in docs/schemas/{schema}.schema.json).",
    )  # fmt: skip


def section_option(default: str | None = None) -> Callable[[F], F]:
    """``--section KEY``: work on one subtree; ``default`` says what is used without it, where
    that is not simply the whole file."""
    note = f"; default: {default}" if default else ""
    return click.option(
        "--section", metavar="KEY",
        help=f"Only the subtree at KEY (e.g. model, optimizer){note}.",
    )  # fmt: skip


def component_option(command: F) -> F:
    """``--component NAME``: one named part of a multi-component folder, as ``--section``
    of that part's key would pick it (never both)."""
    return click.option(
        "--component", metavar="NAME",
        help="Only the part NAME of a multi-component folder (a pipeline's unet; a "
        "sentence-transformers module by number or folder; a file of a zip or folder of "
        "checkpoint files, by its name less the suffix): --section of that part.",
    )(command)  # fmt: skip


def force_option(command: F) -> F:
    """``--force``: replace outputs that exist (refused without it)."""
    return click.option("--force", is_flag=True, help="Replace outputs that already exist.")(
        command
    )


def written_output_options(command: F) -> F:
    """``--max-shard-size SIZE`` and ``--no-verify``, shared by the commands that write a model
    (convert, lora merge)."""
    command = click.option(
        "--no-verify", is_flag=True, help="Skip reading the output back (not advised)."
    )(command)
    return click.option(
        "--max-shard-size", metavar="SIZE",
        help="Shard into files of at most SIZE (2GB, 500MB, 1GiB, bytes) plus an index.",
    )(command)  # fmt: skip


def key_prefix_options(command: F) -> F:
    """``--strip-prefix`` and ``--ignore-wrappers``, shared by the commands that match keys."""
    command = click.option(
        "--ignore-wrappers", is_flag=True,
        help="Remove DDP/torch.compile prefixes (module., _orig_mod.).",
    )(command)  # fmt: skip
    return click.option(
        "--strip-prefix", "strip", multiple=True, metavar="PREFIX",
        help="Remove PREFIX from the start of every tensor name that has it (repeatable).",
    )(command)  # fmt: skip


def remote_options(command: F) -> F:
    """``--full-download`` and ``--verbose``, for the commands that read checkpoints (URLs
    included): they set :data:`ckpttool.io.source.SETTINGS` for the library calls the command makes."""
    import functools

    @functools.wraps(command)
    def run(*args: Any, full_download: bool, verbose: bool, **kwargs: Any) -> Any:
        import sys

        from ckpttool.io.source import SETTINGS

        SETTINGS.full_download, SETTINGS.verbose = full_download, verbose
        if "ckpttool.io.remote" in sys.modules:  # counts are per command (one process may run many)
            sys.modules["ckpttool.io.remote"].reset_totals()
        try:
            return command(*args, **kwargs)
        finally:
            remote = sys.modules.get("ckpttool.io.remote")  # loaded only if a URL was opened
            if verbose and remote is not None and remote.TOTALS.files:
                click.echo(remote.totals_line(), err=True)

    run = click.option(
        "--verbose", "-v", is_flag=True,
        help="For URLs: print the requests made and the bytes fetched (on stderr).",
    )(run)  # fmt: skip
    run = click.option(
        "--full-download", is_flag=True,
        help="For a URL whose server ignores Range requests: download the whole file into "
        "memory instead of refusing it.",
    )(run)  # fmt: skip
    return run  # type: ignore[return-value]


#: The presets ``--map`` knows (ckpttool.model.mapping.PRESETS; a test checks the two agree).
MAP_PRESETS = (
    "llama-meta-to-hf", "llama-hf-to-meta", "llama-gguf-to-hf", "minimind-to-hf-llama",
    "hf-llama-to-minimind", "megatron-gpt-to-hf-llama", "hf-llama-to-megatron-gpt",
)  # fmt: skip


def map_options(what: str, beside: str) -> Callable[[F], F]:
    """``--map FILE|PRESET`` and ``--map-param NAME=N`` (edit, convert, diff): ``what`` is
    mapped, and ``beside`` is where a ``config.json`` supplies the numbers."""

    def decorate(command: F) -> F:
        command = click.option(
            "--map-param", "map_params", multiple=True, metavar="NAME=N",
            help=f"A number the map needs (n_heads=32); default: from a config.json or "
            f"params.json {beside}.",
        )(command)  # fmt: skip
        return click.option(
            "--map", "map_name", metavar="FILE|PRESET",
            help=f"Map {what} with a JSON/YAML map file or a preset ({', '.join(MAP_PRESETS)}): "
            "docs/edit.md.",
        )(command)  # fmt: skip

    return decorate


def use_ema_option(command: F) -> F:
    """``--use-ema [KEY]`` (edit, convert): the EMA weights in place of the model's."""
    return click.option(
        "--use-ema", "use_ema", is_flag=False, flag_value="", default=None, metavar="[KEY]",
        help="Put the EMA weights (KEY, or the one of ema, model_ema, state_dict_ema...) in "
        "place of the model's, and drop the EMA.",
    )(command)  # fmt: skip


def jobs_option(command: F) -> F:
    """``--jobs N``: a directory checkpoint's members worked on by N threads (default: the CPU
    count); the report is the same with any N. Sets :func:`ckpttool.io.parallel.using` for the
    library calls the command makes."""
    return _jobs(
        command,
        "Work on N member files of a directory checkpoint at once (default: the CPU count); "
        "the report is the same with any N, memory grows with N.",
    )


def diff_jobs_option(command: F) -> F:
    """``--jobs N`` of diff: N runs of tensors compared at once, of a file or a directory
    (default: the CPU count); the report is the same with any N."""
    return _jobs(
        command,
        "Compare N runs of tensors at once, of one file or of a directory's members (default: "
        "the CPU count); the report is the same with any N, memory grows with N.",
    )


def combine_jobs_option(command: F) -> F:
    """``--jobs N`` of average and merge: N tensors computed at once (default 1: each thread
    holds several float64 copies of a tensor); the output bytes are the same with any N."""
    return _jobs(
        command,
        "Compute N output tensors at once, N - 1 of them ahead while one is written (default "
        "1); the output is the same with any N, memory grows N-fold.",
    )


def scan_jobs_option(command: F) -> F:
    """``--jobs N`` of scan: N files scanned at once (default: the CPU count)."""
    return _jobs(
        command,
        "Scan N files at once (default: the CPU count); the report is the same with any N.",
    )


def trend_jobs_option(command: F) -> F:
    """``--jobs N`` of trend: N consecutive pairs of checkpoints compared at once."""
    return _jobs(
        command,
        "Compare N pairs of consecutive checkpoints at once (default: the CPU count); the "
        "report is the same with any N, memory grows with N.",
    )


def edit_jobs_option(command: F) -> F:
    """``--jobs N`` of edit: N weights files of a directory, N data files of a DCP directory,
    or N of one file's cast storages worked on at once (default 1: each holds a file's edit or
    a tensor's cast); the output bytes are the same with any N."""
    return _jobs(
        command,
        "Work on N weights files of a directory, N data files of a DCP directory, or N of "
        "one file's casts at once (default 1); the output and the report are the same with "
        "any N, memory grows N-fold.",
    )


def _jobs(command: F, help_text: str) -> F:
    import functools

    @functools.wraps(command)
    def run(*args: Any, jobs: int | None, **kwargs: Any) -> Any:
        from ckpttool.io.parallel import using

        with using(jobs):
            return command(*args, **kwargs)

    return click.option(  # type: ignore[return-value]
        "--jobs", "-j", type=click.IntRange(min=1), metavar="N", help=help_text
    )(run)
