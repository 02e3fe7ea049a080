"""The command line: a thin click layer over the library.

Each command parses its options, calls one library function, renders the result, and turns a
:class:`~ckpttool.errors.CkptError` into a one-line ``Error: ...`` and its exit code.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

import click

from ckpttool import __version__
from ckpttool.cli.options import (
    combine_jobs_option,
    component_option,
    diff_jobs_option,
    edit_jobs_option,
    force_option,
    jobs_option,
    json_option,
    key_prefix_options,
    map_options,
    remote_options,
    scan_jobs_option,
    section_option,
    trend_jobs_option,
    use_ema_option,
    written_output_options,
)
from ckpttool.cli.ranks import lead_result, on_ranks, runs_alone_off_lead
from ckpttool.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    STOP_SIGNALS,
    CkptError,
    InputError,
    Stopped,
)

EXIT_CODES_HELP = """\b
Exit codes:
    0  success (diff: no differences; verify/scan: every path checked, nothing found)
    1  diff: the checkpoints differ; verify/scan: a problem was found in any path;
       convert, rescale-step: the written file failed verification (it was removed);
       repair: something stays lost or damaged
    2  error: missing/unreadable/corrupt/unsafe input, bad usage; verify/scan: a path
       could not be checked (or held no checkpoint) and nothing was found elsewhere
  130  interrupted (Ctrl-C): files being written were removed, the inputs untouched;
       SIGTERM (143) and SIGHUP (129) do the same
  141  stdout was closed early (| head): the output stops there, with no message"""


class CkptGroup(click.Group):
    """A click group that turns library errors into one line on stderr and an exit code, and
    Ctrl-C and a closed stdout into theirs (click's own handling would exit 1, "found")."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:  # fmt: skip
        with _stopped_quietly():  # parsing, --help, --version
            return super().make_context(info_name, args, parent, **extra)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and runs_alone_off_lead(command.callback):
            sys.exit(0)  # under torchrun, off rank 0: rank 0 runs this command alone
        return name, command, rest

    def invoke(self, ctx: click.Context) -> object:
        with _stopped_quietly():
            try:
                return super().invoke(ctx)
            except CkptError as error:
                _fail(_in_cli_words(str(error)), error.exit_code)
            except click.BadParameter as error:  # a path argument click checked (unreadable)
                if not isinstance(error.param, click.Argument) or not isinstance(
                    error.param.type, click.Path
                ):
                    raise
                _fail(error.format_message(), EXIT_ERROR)
            except MemoryError:
                _fail("out of memory while reading the file", EXIT_ERROR)
            except BrokenPipeError:  # stdout closed: _stopped_quietly's, not an error to print
                raise
            except OSError as error:  # a disk or permission problem the library did not expect
                where = f": {error.filename}" if error.filename else ""
                _fail(f"{error.strerror or error}{where}", EXIT_ERROR)
            except RuntimeError as error:  # Path.resolve() before Python 3.13 (then ELOOP)
                if not str(error).startswith("Symlink loop from "):
                    raise
                _fail(str(error), EXIT_ERROR)


@contextlib.contextmanager
def _stopped_quietly() -> Iterator[None]:
    """Ctrl-C ends the command with one line and :data:`EXIT_INTERRUPTED`; a closed stdout
    with no line and :data:`EXIT_PIPE_CLOSED`, in every command and output mode.

    Both arrive as exceptions, so the library's cleanup runs on the way (temp files removed,
    the user's files untouched), and nothing is printed as a traceback. stdout is flushed here,
    on a ``sys.exit`` too, so that a pipe closed after the last write is seen here, not by the
    interpreter at exit (an "Exception ignored" message and exit 120).
    """
    try:
        try:
            yield
        except SystemExit:
            _flush_stdout(failure_reported=True)
            raise
        _flush_stdout(failure_reported=False)
    except KeyboardInterrupt as stop:
        _interrupted(stop)
    except BrokenPipeError:
        _pipe_closed()


def _flush_stdout(*, failure_reported: bool) -> None:
    """Flush stdout; if that fails (a full disk), drop what it holds, so that nothing tries
    again at exit, and say so in one line unless the command has already failed (``click.echo``
    flushes after each write: output still held means a write failed, and said so, before)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as error:
        _stdout_to_devnull()
        if not failure_reported:
            _fail(f"writing the output failed: {error.strerror or error}", EXIT_ERROR)


def _interrupted(stop: KeyboardInterrupt) -> NoReturn:
    if isinstance(stop, Stopped):
        from ckpttool.io.units import launched_ranks

        # torchrun stops the other ranks with SIGTERM when one fails, and names the failure
        # itself: a rank stopped so cleans up without a line of its own (one error, not N)
        if launched_ranks() is None:
            click.echo(f"Error: interrupted ({stop.name})", err=True)
        sys.exit(128 + stop.signal_number)
    # a terminal shows "^C" where the cursor is: the line starts on a line of its own
    lead = "\n" if sys.stderr.isatty() else ""
    click.echo(f"{lead}Error: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


def _stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP raise :class:`~ckpttool.errors.Stopped` (a KeyboardInterrupt) in the
    main thread, so that they take Ctrl-C's one path: every write's cleanup runs, the inputs
    stay untouched, one line, exit 128 + signal. A signal ignored when the command started
    (``nohup``) stays ignored. Once one arrived, further ones are ignored so that the cleanup
    it started is not cut short (a second Ctrl-C still is; SIGKILL leaves only temp files,
    which ``verify`` reports and ``repair --clean`` removes). ``--jobs`` workers reset them (:mod:`ckpttool.io.parallel`); each
    torchrun rank is a command of its own and runs this too."""

    def stop(signal_number: int, frame: object) -> None:
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        raise Stopped(signal_number, signal.Signals(signal_number).name)

    for number in STOP_SIGNALS:
        if signal.getsignal(number) is not signal.SIG_IGN:
            with contextlib.suppress(ValueError):  # main() called off the main thread
                signal.signal(number, stop)


def _pipe_closed() -> NoReturn:
    """Whatever read stdout is gone: stop quietly, as ``cat`` and ``git`` do under ``| head``.

    stdout becomes /dev/null so that the interpreter's own flush at exit, of what is still
    buffered, does not fail again (Python's documented way, "Note on SIGPIPE").
    """
    _stdout_to_devnull()
    sys.exit(EXIT_PIPE_CLOSED)


def _stdout_to_devnull() -> None:
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


#: The library's words for its options, as the command line spells them: a library error names
#: the keyword argument a caller passes, and is read at the command line with the flag instead.
CLI_WORDS = (
    ("(pass overwrite=True", "(pass --force"),
    ("pass in_place to", "pass --in-place to"),
    ("give an output or in_place, not both", "give -o or --in-place, not both"),
    ("an output path and fill_from apply", "-o and --fill-from apply"),
    ("backup applies to", "--backup applies to"),
)


def _in_cli_words(message: str) -> str:
    for python, flag in CLI_WORDS:
        message = message.replace(python, flag)
    return message


def _fail(message: str, exit_code: int) -> NoReturn:
    """One line on stderr, whatever the message holds, then the exit code."""
    click.echo("Error: " + " ".join(message.split()), err=True)
    sys.exit(exit_code)


@click.group(
    cls=CkptGroup,
    help="Inspect, compare, convert and repair PyTorch checkpoints.\n\n" + EXIT_CODES_HELP,
)
@click.version_option(__version__, prog_name="ckpttool")
def cli() -> None:
    pass


#: The collector's generation-0 threshold for a CLI run (Python's default is 700). A command
#: reads a checkpoint into one tree that lives until it exits, so each collection traverses
#: objects that cannot be garbage: at 100,000 tensors the default thresholds cost a quarter of
#: `show --json`'s CPU time. Collections still run, so cycles are still freed.
GC_THRESHOLD = (100_000, 50, 100)


def main() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    _stop_like_ctrl_c()
    _stdout_writes_all()
    with _stopped_quietly():  # the instants before click's main and after it
        cli(prog_name="ckpttool")


def _stdout_writes_all() -> None:
    """Put a buffer under stdout where ``PYTHONUNBUFFERED`` (``-u``, common in containers)
    took it away.

    Without one, a write stdout's descriptor takes only in part (the reader of a pipe gone
    mid-write, a full disk) loses the rest without an error: the command would exit 0 with its
    output cut. A ``BufferedWriter`` writes everything or raises. ``click.echo`` flushes after
    each write, so the output is as prompt as unbuffered.
    """
    stream = sys.stdout
    raw = getattr(stream, "buffer", None)
    if isinstance(stream, io.TextIOWrapper) and isinstance(raw, io.RawIOBase):
        sys.stdout = io.TextIOWrapper(
            io.BufferedWriter(raw), encoding=stream.encoding, errors=stream.errors,
            write_through=True,
        )  # fmt: skip


def _input_bytes(path: str) -> int:
    """Bytes a check reads: a file's size, or the files of a directory checkpoint (DCP)."""
    if os.path.isdir(path):
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    return os.path.getsize(path) if os.path.isfile(path) else 0


def _echo_json(data: object) -> None:
    from ckpttool.render.json_text import chunks

    for chunk in chunks(data):  # written as made: the whole text is never held at once
        click.echo(chunk, nl=False)
    click.echo()


@cli.command()
@click.argument("path", type=click.Path(path_type=str))
@json_option("show")
@click.option(
    "--filter", "pattern", metavar="GLOB",
    help="Only tensors whose key (as listed, e.g. model.layers.0.*) matches GLOB.",
)  # fmt: skip
@section_option()
@component_option
@click.option("--stats", is_flag=True, help="Read values: min/max/mean/std(ddof=0), NaN/Inf.")
@click.option("--tree", is_flag=True, help="Print the nesting of the object tree instead.")
@click.option("--depth", type=click.IntRange(min=0), help="Limit --tree to this depth.")
@click.option(
    "--objects", is_flag=True,
    help="--tree of the objects as pickled: a pickled nn.Module with its class and every "
    "attribute, not read as its state dict.",
)  # fmt: skip
@remote_options
def show(
    path: str,
    as_json: bool,
    pattern: str | None,
    section: str | None,
    component: str | None,
    stats: bool,
    tree: bool,
    depth: int | None,
    objects: bool,
) -> None:
    """Describe a checkpoint without loading it and without running its pickle.

    Reads torch.save files (zip and legacy), safetensors, plain pickles and
    torch.distributed.checkpoint directories (global shapes, chunks and their rank files).
    Tensor bytes are read only with --stats. Exit 0 when shown, 1 when a framework's
    directory is incomplete (a file its framework writes is missing: listed under missing:,
    the rest shown), 2 on error.

    \b
    Examples:
      ckpttool show checkpoints/pretrain_768_resume.pth
      ckpttool show out/pretrain_768.pth --filter '*layers.0.*' --stats
      ckpttool show ckpt.pth --section optimizer --json
      ckpttool show pipeline/ --component unet      # one part of a diffusers pipeline
      ckpttool show ckpt.pth --tree --depth 2
      ckpttool show checkpoints/step_1200/    # a DCP directory
    """
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.commands.selection import side_section
    from ckpttool.commands.show import build_report, check_collection
    from ckpttool.errors import CheckpointCollectionError
    from ckpttool.render import show as show_render
    from ckpttool.render import show_tree

    try:
        ckpt = open_checkpoint(path)
    except CheckpointCollectionError as collection:  # a Trainer output_dir: list what it holds
        check_collection(collection.layout)
        listing = show_render.collection_json(collection.layout)
        if as_json:
            _echo_json(listing)
        else:
            click.echo(show_render.collection_text(listing))
        return
    with ckpt:
        section = side_section(ckpt, section, component)
        if tree or depth is not None or objects:
            whole = ckpt.objects if objects else ckpt.root
            root = ckpt.section(section, objects=objects) if section else whole
            if as_json:
                _echo_json(show_tree.render_json(root))
            else:
                click.echo(show_tree.render_text(root, depth))
            return
        report = build_report(
            ckpt, section=section, pattern=pattern, stats=stats, all_fields=as_json
        )
        # a directory missing a file its framework writes holds less than it should: found
        incomplete = bool(ckpt.details.get("missing"))
    if as_json:
        for chunk in show_render.json_chunks(report):  # each tensor's line made as written
            click.echo(chunk, nl=False)
        click.echo()
    else:
        click.echo(show_render.render_text(report))
        for warning in report.warnings:
            click.echo(f"warning: {warning}", err=True)
    if incomplete:
        sys.exit(1)


@cli.command("diff")
@click.argument("path_a", metavar="A", type=click.Path(path_type=str))
@click.argument("path_b", metavar="B", type=click.Path(path_type=str))
@click.option(
    "--rtol", type=click.FloatRange(min=0), default=1e-5, show_default=True,
    help="Relative tolerance (as torch.allclose: |a-b| <= atol + rtol*|b|).",
)  # fmt: skip
@click.option(
    "--atol", type=click.FloatRange(min=0), default=1e-8, show_default=True,
    help="Absolute tolerance.",
)  # fmt: skip
@section_option()
@click.option(
    "--section-a", metavar="KEY",
    help="Compare only the subtree KEY of A (overrides --section for A). A side that no "
    "section option names is compared whole.",
)  # fmt: skip
@click.option(
    "--section-b",
    metavar="KEY",
    help="Compare only the subtree KEY of B (overrides --section for B).",
)
@component_option
@click.option(
    "--component-a", metavar="NAME",
    help="Compare only the part NAME of A (overrides --component for A).",
)  # fmt: skip
@click.option(
    "--component-b", metavar="NAME",
    help="Compare only the part NAME of B (overrides --component for B).",
)  # fmt: skip
@key_prefix_options
@click.option(
    "--rounded", is_flag=True,
    help="Compare floats of different precision (float32 and float16, ...) after rounding the "
    "wider side to the narrower dtype as tensor.to(dtype) does: is B exactly A rounded to B's "
    "dtype (or A exactly B rounded to A's)?",
)  # fmt: skip
@click.option(
    "--all", "show_all", is_flag=True,
    help="List every tensor, identical (and equal after rounding) ones too, and every field "
    "only one side holds (else more than 3 under one entry are one line: 'optimizer: 26 "
    "fields only in B').",
)  # fmt: skip
@click.option("--quick", is_flag=True, help="Structure, dtypes, shapes, fields; read no values.")
@map_options("A's tensor names and layout into B's (as edit --map)", "beside A or B")
@click.option(
    "--by-module", is_flag=True,
    help="Roll the tensors up by module, repeated blocks folded (layers.#.mlp.up_proj): per "
    "group the parameter-weighted relative change sqrt(sum |dW|^2)/sqrt(sum |W|^2), with a bar.",
)  # fmt: skip
@click.option(
    "--top", type=click.IntRange(min=1), metavar="N",
    help="List the N tensors with the largest relative change |B-A|/|A|, with a bar.",
)  # fmt: skip
@click.option(
    "--plot", "plot_path", metavar="FILE", type=click.Path(path_type=str),
    help="Also draw the relative change per layer x module (heatmap) and the most changed "
    "tensors (bars) into FILE (.png or .svg; needs pip install 'ckpttool[plot]').",
)  # fmt: skip
@json_option("diff")
@remote_options
@diff_jobs_option
def diff_command(
    path_a: str,
    path_b: str,
    rtol: float,
    atol: float,
    section: str | None,
    section_a: str | None,
    section_b: str | None,
    component: str | None,
    component_a: str | None,
    component_b: str | None,
    strip: tuple[str, ...],
    ignore_wrappers: bool,
    rounded: bool,
    show_all: bool,
    quick: bool,
    map_name: str | None,
    map_params: tuple[str, ...],
    by_module: bool,
    top: int | None,
    plot_path: str | None,
    as_json: bool,
) -> None:
    """Compare two checkpoints: tensors, dtypes, shapes, values, and training fields.

    Any two inputs ckpttool reads (torch zip, legacy, safetensors, DCP directories). A resume
    file against a plain state dict compares the resume file's model. When the two sides share
    no tensor key but one side's keys are the other's under one extra prefix (model.,
    model_state_dict., module.), they are aligned there, with a note. Two DeepSpeed tags are
    compared as their fp32 weights and as their files store them (module copies, optimizer
    states, counters, client state); what only one side's kind holds is named in a note, not
    compared. Values are streamed one tensor pair at a time. The table lists the tensors that
    differ (--all: every tensor). Exits 0 when every tensor and field both hold is equal within
    tolerance, 1 when they differ, 2 on error.

    \b
    Examples:
      ckpttool diff out/pretrain_768.pth checkpoints/pretrain_768_resume.pth --rounded
      ckpttool diff run1/ckpt.pth run2/ckpt.pth --rtol 1e-3 --all
      ckpttool diff ddp.pth model.safetensors --ignore-wrappers
      ckpttool diff tutorial.pt model.pth --section-a model_state_dict
      ckpttool diff pipeline/ unet/ --component-a unet
      ckpttool diff a_resume.pth b_resume.pth --quick --json
      ckpttool diff checkpoints/step_1200/ model.safetensors
      ckpttool diff base.safetensors finetuned.safetensors --by-module --top 10
    """
    from ckpttool.commands.diff.modules import by_module as rollup
    from ckpttool.commands.diff.modules import top_changed
    from ckpttool.commands.diff.run import open_side, plan_diff, run_diff, with_derived
    from ckpttool.commands.selection import Selection
    from ckpttool.errors import EXIT_FOUND
    from ckpttool.render import diff as diff_render

    if quick and (by_module or top or plot_path):
        raise click.UsageError(
            "--by-module, --top and --plot measure values, which --quick does not read"
        )
    if not quick:
        from ckpttool.io.memory import reuse_freed_memory

        reuse_freed_memory()  # value chunks' temporaries without page faults (our process)
    if plot_path is not None:
        from ckpttool.render.plot import pyplot

        pyplot(plot_path)  # the extra is there, the suffix is known: before any work
    selection = Selection(
        section, strip, ignore_wrappers, map=map_name,
        map_params=tuple(_int_params(map_params).items()), component=component,
    )  # fmt: skip
    with open_side(path_a) as opened_a, open_side(path_b) as ckpt_b:
        ckpt_a = with_derived(opened_a) if map_name is not None else opened_a
        plan = plan_diff(
            ckpt_a, ckpt_b, selection, section_a=section_a, section_b=section_b,
            component_a=component_a, component_b=component_b,
        )  # fmt: skip
        options: dict[str, Any] = {"rtol": rtol, "atol": atol, "rounded": rounded}
        if by_module or plot_path:
            options["norms"] = True
        if quick:  # nothing to read, so no bar (and no import of its renderer)
            report = run_diff(ckpt_a, ckpt_b, plan, quick=True, **options)
        else:
            from ckpttool.io.progress import Progress

            with Progress(plan.value_bytes, "diff") as bar:
                report = run_diff(ckpt_a, ckpt_b, plan, progress=bar.advance, **options)
    views: dict[str, Any] = {
        "modules": rollup(report) if by_module else None,
        "top": top_changed(report, top) if top else None,
    }
    if plot_path is not None:
        from ckpttool.render import plot

        figure = plot.diff_figure(
            report, rollup(report), top_changed(report, top or plot.TOP_DEFAULT), plot_path
        )
        plot.save(figure, plot_path)
    if as_json:
        _echo_json(diff_render.render_json(report) | diff_render.views_json(**views))
    else:
        click.echo(diff_render.render_text(report, show_all=show_all, **views))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    if not report.equal:
        sys.exit(EXIT_FOUND)


@cli.command("trend")
@click.argument(
    "paths", metavar="CHECKPOINTS...", nargs=-1, required=True, type=click.Path(path_type=str)
)
@click.option(
    "--tensors", "by_tensor", is_flag=True,
    help="A row per tensor instead of per module group.",
)  # fmt: skip
@click.option(
    "--plot", "plot_path", metavar="FILE", type=click.Path(path_type=str),
    help="Also draw each module group's norm and update size over the steps, the first "
    "NaN/Inf marked, into FILE (.png or .svg; needs pip install 'ckpttool[plot]').",
)  # fmt: skip
@json_option("trend")
@trend_jobs_option
def trend_command(
    paths: tuple[str, ...], by_tensor: bool, plot_path: str | None, as_json: bool
) -> None:
    """Follow a run's weights across its checkpoints: norms, updates, NaN/Inf, frozen tensors.

    CHECKPOINTS are files, or one run directory (a Trainer output_dir, a DeepSpeed save
    directory, torchtitan's step-N/ folder, torchtune's epoch_N/ output_dir, a directory of
    resume files), ordered by step (the checkpoints' own counters, else the numbers in their
    names). Per module group (layers.#.mlp.up_proj; --tensors: per
    tensor) its norm and its relative update from the previous checkpoint; then the first
    checkpoint holding a NaN or an Inf and in which tensors, the tensors that never changed,
    and the update jumps (more than 10x the median of the group's previous updates). Values are
    streamed, one tensor of two checkpoints at a time. Exits 0 when no checkpoint holds a NaN
    or an Inf, 1 when one does, 2 on error.

    \b
    Examples:
      ckpttool trend out/checkpoints/
      ckpttool trend step_100.pth step_200.pth step_300.pth --json
      ckpttool trend output_dir/ --tensors
    """
    from ckpttool.commands.trend import trend
    from ckpttool.errors import EXIT_FOUND
    from ckpttool.render import trend as trend_render

    if plot_path is not None:
        from ckpttool.render.plot import pyplot

        pyplot(plot_path)  # before any work
    report = trend(paths)
    if plot_path is not None:
        from ckpttool.render import plot

        plot.save(plot.trend_figure(report, plot_path), plot_path)
    if as_json:
        _echo_json(trend_render.render_json(report))
    else:
        click.echo(trend_render.render_text(report, by_tensor=by_tensor))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    if not report.healthy:
        sys.exit(EXIT_FOUND)


@cli.command("rescale-step")
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--world-size", "world_size", type=click.IntRange(min=1), required=True, metavar="N",
    help="Number of GPUs (ranks) the run will resume on.",
)  # fmt: skip
@click.option(
    "--from-world-size", type=click.IntRange(min=1), metavar="M",
    help="Number of GPUs the step was counted on, for files without (or with a wrong) world_size.",
)  # fmt: skip
@click.option(
    "--batch-size", type=click.IntRange(min=1), metavar="B",
    help="Per-rank batch size, to report the repeated samples in samples.",
)  # fmt: skip
@click.option("--strict", is_flag=True, help="Refuse when the new step cannot be exact.")
@click.option(
    "--step-key", metavar="KEY",
    help="Top-level field to rescale instead of 'step' (also allows non-resume layouts; of a "
    "directory, the counter its framework rescales only when named: Lightning sharded's "
    "global_step).",
)  # fmt: skip
@click.option("-o", "--output", metavar="OUT", help="Write to OUT instead of in place.")
@force_option
@click.option(
    "--backup",
    is_flag=True,
    help="Keep the original as PATH.bak (never overwritten; one an interrupted run "
    "left, the same bytes as PATH, is replaced).",
)
@click.option(
    "--in-place", is_flag=True,
    help="For a directory: replace it (default: write PATH.wsN, or -o OUT).",
)  # fmt: skip
@click.option(
    "--keep-global-batch", is_flag=True,
    help="DeepSpeed: the new run keeps the global batch (more accumulation); keep the counters.",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@json_option("rescale-step")
def rescale_step(
    path: str,
    world_size: int,
    from_world_size: int | None,
    batch_size: int | None,
    strict: bool,
    step_key: str | None,
    output: str | None,
    force: bool,
    backup: bool,
    in_place: bool,
    keep_global_batch: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Repair a resume checkpoint's step for a different number of GPUs.

    step counts batches per rank: new step = step x saved world_size // N, and world_size
    becomes N. The file is rewritten atomically, tensors copied byte for byte (never loaded),
    and the change is recorded in its 'rescaled_from' list.

    A Trainer checkpoint-N/ or an accelerate save_state folder is rewritten as a whole to a new
    directory (PATH.wsN; a Trainer OUTPUT_DIR/checkpoint-N goes to OUTPUT_DIR.wsN/checkpoint-M,
    where Trainer resumes from it; or -o OUT; --in-place to replace it): global_step /
    accelerate's step, the scheduler's counters and the per-rank RNG files
    (docs/rescale-step.md).

    A DeepSpeed ZeRO-1/2/3 save or tag directory is written, without DeepSpeed, as the
    universal checkpoint DeepSpeed resumes from on N ranks ("load_universal": true):
    global_steps and the scheduler rescaled like step (--keep-global-batch: kept).

    \b
    Examples:
      ckpttool rescale-step checkpoints/pretrain_768_resume.pth --world-size 2 --dry-run
      ckpttool rescale-step checkpoints/pretrain_768_resume.pth --world-size 2 --backup
      ckpttool rescale-step old_resume.pth --world-size 4 --from-world-size 8 -o new_resume.pth
      ckpttool rescale-step last.ckpt --world-size 2 --from-world-size 4 --step-key global_step
      ckpttool rescale-step output/checkpoint-500 --world-size 4  # output.ws4/checkpoint-<step>
      ckpttool rescale-step ds_checkpoints/ --world-size 4 -o ds_universal/
    """
    import os

    from ckpttool.commands.rescale.run import RescaleTarget, rescale_file
    from ckpttool.io.progress import Progress
    from ckpttool.render import rescale as rescale_render

    target = RescaleTarget(
        world_size, from_world_size=from_world_size, batch_size=batch_size, strict=strict,
        step_key=step_key, keep_global_batch=keep_global_batch,
    )  # fmt: skip
    if os.path.isdir(path):
        from ckpttool.commands.rescale.directory import rescale_directory_to

        if backup:
            raise InputError("--backup applies to one checkpoint file")
        directory_report = rescale_directory_to(
            path, target, output=output, in_place=in_place, overwrite=force, dry_run=dry_run
        )
        if as_json:
            _echo_json(rescale_render.render_json(directory_report))
        else:
            click.echo(rescale_render.render_text(directory_report))
        return
    if in_place:
        raise InputError(
            "--in-place applies to a directory; a file is rewritten in place by default"
        )
    with Progress(os.path.getsize(path) if os.path.isfile(path) else 0, "rescale") as bar:
        report = rescale_file(
            path, target, output=output, overwrite=force, backup=backup, dry_run=dry_run,
            progress=bar.advance,
        )  # fmt: skip
    if as_json:
        _echo_json(rescale_render.render_json(report))
    else:
        click.echo(rescale_render.render_text(report))


@cli.command("convert")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", required=False, type=click.Path(path_type=str))
@click.option(
    "--to", "to", type=click.Choice(["safetensors", "pth"]),
    help="Output format (default: from DST's suffix; safetensors without DST).",
)  # fmt: skip
@click.option(
    "--dtype", type=click.Choice(["keep", "fp16", "bf16", "fp32"]), default="keep",
    show_default=True, help="Cast floating tensors (integer tensors are never cast).",
)  # fmt: skip
@click.option("--allow-overflow", is_flag=True, help="Write values too large for --dtype as inf.")
@section_option(default="the weights")
@component_option
@key_prefix_options
@click.option(
    "--filter", "pattern", metavar="GLOB",
    help="Only tensors whose key (as show lists it) or written name matches GLOB.",
)  # fmt: skip
@click.option(
    "--drop", multiple=True, metavar="GLOB",
    help="Leave out the tensors whose key or written name matches; repeatable (as edit's).",
)  # fmt: skip
@click.option(
    "--rename", multiple=True, metavar="REGEX=REPLACEMENT",
    help="Change the written names (re.sub, \\1 for groups); repeatable, in order (as edit's).",
)  # fmt: skip
@map_options("the written names and layout (after --drop and --rename, as edit)", "beside SRC")
@use_ema_option
@click.option("--keep-shared", is_flag=True, help="Write tied tensors as separate copies.")
@click.option("--densify", is_flag=True, help="Store sparse tensors as their dense values.")
@click.option("--dequantize", is_flag=True, help="Store quantized tensors as their float32 values.")
@click.option(
    "--skip-missing-values", is_flag=True,
    help="Leave out selected tensors the file has no values of (DTensor shards, meta tensors) "
    "instead of refusing to convert.",
)  # fmt: skip
@written_output_options
@force_option
@json_option("convert")
@remote_options
@jobs_option
@on_ranks
def convert_command(
    src: str,
    dst: str | None,
    to: str | None,
    dtype: str,
    allow_overflow: bool,
    section: str | None,
    component: str | None,
    strip: tuple[str, ...],
    ignore_wrappers: bool,
    pattern: str | None,
    drop: tuple[str, ...],
    rename: tuple[str, ...],
    map_name: str | None,
    map_params: tuple[str, ...],
    use_ema: str | None,
    keep_shared: bool,
    densify: bool,
    dequantize: bool,
    skip_missing_values: bool,
    max_shard_size: str | None,
    no_verify: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Convert weights to safetensors (or a plain .pth) and verify the result bit for bit.

    SRC may be a weights file, a resume checkpoint (its model), a Lightning .ckpt (its
    state_dict), a legacy torch file, a safetensors file or a torch.distributed.checkpoint
    directory (its shards assembled tensor by tensor), or a Hugging Face model directory or
    Trainer checkpoint-N/ (its model); for these, a DST that is a directory (existing, ending
    in /, or without a suffix) gets a model directory from_pretrained loads: model.safetensors
    (or shards and model.safetensors.index.json), config.json and generation_config.json
    copied byte for byte, written all or nothing. DST defaults to SRC with a
    .safetensors suffix (.pth with --to pth), or NAME.converted.SUFFIX when that would be SRC
    itself (c_ddp.pth --to pth writes c_ddp.converted.pth); a directory DST (existing, or
    ending in /: created) gets that name in it. Tied tensors are stored once, their names kept
    in __metadata__. The output is written atomically and read back before it replaces
    anything. A file with no model weights (only optimizer, RNG or scheduler state: torchtune's
    recipe_state.pt) is refused (exit 2) unless --section or --filter picks its tensors.

    \b
    Examples:
      ckpttool convert out/pretrain_768.pth
      ckpttool convert checkpoints/pretrain_768_resume.pth model.safetensors --dtype bf16
      ckpttool convert model.safetensors model.pth
      ckpttool convert ddp.pth --ignore-wrappers --filter 'model.layers.*'
      ckpttool convert ddp.pth --strip-prefix module. --to pth   # ddp.converted.pth
      ckpttool convert big.pth shards/ --max-shard-size 2GB
      ckpttool convert checkpoints/step_1200/ model.safetensors
      ckpttool convert output/checkpoint-500/ llama-500/   # a from_pretrained directory
      ckpttool convert pipeline/ unet.safetensors --component unet
    """
    from ckpttool.commands.convert.options import ConversionOptions
    from ckpttool.commands.convert.run import convert_with
    from ckpttool.commands.selection import Selection
    from ckpttool.io.memory import reuse_freed_memory
    from ckpttool.io.progress import Progress
    from ckpttool.render import convert as convert_render

    reuse_freed_memory()  # each tensor's buffers without page faults (this process is ours)

    selection = Selection(
        section, strip, ignore_wrappers, pattern, drop, rename, map=map_name,
        map_params=tuple(_int_params(map_params).items()), use_ema=use_ema, component=component,
    )  # fmt: skip
    options = ConversionOptions(
        to=to, dtype=dtype, allow_overflow=allow_overflow, keep_shared=keep_shared,
        densify=densify, dequantize=dequantize, skip_missing_values=skip_missing_values,
        max_shard_size=max_shard_size, verify=not no_verify,
    )  # fmt: skip
    with Progress(0, "convert") as bar:
        report = lead_result(
            lambda: convert_with(
                src, dst, selection, options, force=force, progress=bar.advance,
                on_total=lambda n: setattr(bar, "total", max(n, 1)),
            )
        )  # fmt: skip
    if as_json:
        _echo_json(convert_render.render_json(report))
    else:
        click.echo(convert_render.render_text(report))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)


@cli.command("average")
@click.argument(
    "paths", metavar="CHECKPOINTS...", nargs=-1, required=True, type=click.Path(path_type=str)
)
@click.option(
    "-o", "--output", "output", metavar="OUT", required=True, type=click.Path(path_type=str),
    help="The averaged weights: a .safetensors file, or .pth (.pt, .bin); with --like-input, "
    "a file (or directory) like the newest checkpoint.",
)  # fmt: skip
@click.option(
    "--weights", "weights", metavar="W1,W2,...",
    help="One weight per checkpoint, in the order given (normalised to sum to 1).",
)  # fmt: skip
@click.option(
    "--last", "last", type=int, metavar="N",
    help="CHECKPOINTS is one run directory: average its N newest complete checkpoints "
    "(fewer there: those, with a note).",
)  # fmt: skip
@click.option(
    "--ema", "ema", type=float, metavar="DECAY",
    help="An exponential moving average in step order (DECAY between 0 and 1) instead of a mean.",
)  # fmt: skip
@click.option(
    "--dtype", type=click.Choice(["keep", "fp16", "bf16", "fp32"]), default="keep",
    show_default=True, help="Round floating tensors to this dtype (keep: their own).",
)  # fmt: skip
@click.option(
    "--ints", type=click.Choice(["equal", "last"]), default="equal", show_default=True,
    help="Integer and bool tensors: refuse unless equal in every checkpoint, or take the last's.",
)  # fmt: skip
@click.option(
    "--filter", "pattern", metavar="GLOB",
    help="Only tensors whose key (as show lists it) or written name matches GLOB (as convert's).",
)  # fmt: skip
@map_options("every checkpoint's names and layout before they are matched (as convert)",
             "beside each checkpoint")  # fmt: skip
@click.option(
    "--like-input", is_flag=True,
    help="Write OUT in the newest checkpoint's own layout (a resume .pth with its step, "
    "optimizer and other entries, a safetensors file, a model directory) instead of a weights "
    "file.",
)  # fmt: skip
@click.option(
    "--no-verify", is_flag=True, help="Skip reading the output back (not advised)."
)  # fmt: skip
@force_option
@json_option("average")
@combine_jobs_option
def average_command(
    paths: tuple[str, ...],
    output: str,
    weights: str | None,
    last: int | None,
    ema: float | None,
    dtype: str,
    ints: str,
    pattern: str | None,
    map_name: str | None,
    map_params: tuple[str, ...],
    like_input: bool,
    no_verify: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Average the weights of checkpoints, one tensor at a time, into one weights file.

    CHECKPOINTS are files or directories of any layout ckpttool reads (their weights, as
    convert takes them), or one run directory (with --last N: its N newest complete
    checkpoints, broken ones skipped and named; fewer than N: those, with a note, exit 0).
    Each floating tensor is summed in float64 one checkpoint at a time and rounded once to its dtype (or --dtype): the mean, the weighted
    mean with --weights, or the EMA in step order with --ema (the oldest weighs DECAY^(n-1),
    the k-th (1-DECAY)*DECAY^(n-k)). Integer and bool tensors must be equal everywhere (or
    --ints last). A tensor missing from a checkpoint, or of another shape, is refused by
    name (exit 2, nothing written). --filter and --map work as convert's, on every checkpoint.
    OUT is written atomically and read back; a .safetensors OUT records the inputs, their
    steps and weights in its __metadata__. With --like-input OUT is the newest checkpoint
    (by step) again (a resume file keeps its optimizer and counters) with the averaged weights.
    Memory: the float64 sum and one checkpoint's tensor at a time (--jobs N: N times that).
    PEFT LoRA adapters (every checkpoint): OUT is one adapter directory of summed rank whose
    delta is the mean of theirs, as PEFT's add_weighted_adapter "cat" (DoRA is refused).

    \b
    Examples:
      ckpttool average step_800.pth step_900.pth step_1000.pth -o avg.safetensors
      ckpttool average --last 5 out/checkpoints/ -o last5.safetensors
      ckpttool average a.pth b.pth --weights 3,1 -o mix.pth
      ckpttool average --last 10 output_dir/ --ema 0.9 -o ema.safetensors --json
      ckpttool average --last 3 out/ -o avg_resume.pth --like-input
    """
    from ckpttool.commands.average import average
    from ckpttool.io.progress import Progress
    from ckpttool.render import average as average_render

    parsed = _weights(weights)
    with Progress(0, "average") as bar:
        report = average(
            paths, output, weights=parsed, last=last, ema=ema, dtype=dtype, ints=ints,
            pattern=pattern, map_name=map_name, map_params=_int_params(map_params),
            like_input=like_input, force=force, verify=not no_verify, progress=bar.advance,
            on_total=lambda n: setattr(bar, "total", max(n, 1)),
        )  # fmt: skip
    if as_json:
        _echo_json(average_render.render_json(report))
    else:
        click.echo(average_render.render_text(report))
    for skipped in report.skipped:
        click.echo(f"skipped: {skipped}", err=True)
    for note in report.notes:
        click.echo(f"note: {note}", err=True)


@cli.command("merge")
@click.argument("base", metavar="BASE", type=click.Path(path_type=str))
@click.argument(
    "models", metavar="MODEL...", nargs=-1, required=True, type=click.Path(path_type=str)
)
@click.option(
    "-o", "--output", "output", metavar="OUT", required=True, type=click.Path(path_type=str),
    help="The merged weights: a .safetensors file, or .pth (.pt, .bin); with --like-input, a "
    "file (or directory) like BASE.",
)  # fmt: skip
@click.option(
    "--method", type=click.Choice(["linear", "task-arithmetic", "ties", "slerp"]),
    required=True, help="How to merge (mergekit's formulas; docs/merge.md).",
)  # fmt: skip
@click.option(
    "--weights", "weights", metavar="W1,W2,...",
    help="linear: one per input, BASE first (normalised); task-arithmetic, ties: one per MODEL "
    "(default 1 each).",
)  # fmt: skip
@click.option(
    "--lambda", "lam", type=float, default=1.0, show_default=True,
    help="task-arithmetic, ties: the scale of the mixed task vector.",
)  # fmt: skip
@click.option(
    "--density", type=float, default=1.0, show_default=True,
    help="ties: the fraction of each task vector kept, largest magnitudes first.",
)  # fmt: skip
@click.option("--t", "t", type=float, help="slerp: 0 gives BASE, 1 gives MODEL.")
@click.option(
    "--dtype", type=click.Choice(["keep", "fp16", "bf16", "fp32"]), default="keep",
    show_default=True, help="Round floating tensors to this dtype (keep: the base's).",
)  # fmt: skip
@click.option(
    "--filter", "pattern", metavar="GLOB",
    help="Only BASE's tensors whose key (as show lists it) or written name matches GLOB.",
)  # fmt: skip
@map_options("each MODEL's names and layout into BASE's (a MODEL named as BASE: as it is)",
             "beside each MODEL")  # fmt: skip
@click.option(
    "--like-input", is_flag=True,
    help="Write OUT in BASE's own layout (a resume .pth with its other entries, a safetensors "
    "file, a model directory) instead of a weights file.",
)  # fmt: skip
@click.option(
    "--no-verify", is_flag=True, help="Skip reading the output back (not advised)."
)  # fmt: skip
@force_option
@json_option("merge")
@combine_jobs_option
def merge_command(
    base: str,
    models: tuple[str, ...],
    output: str,
    method: str,
    weights: str | None,
    lam: float,
    density: float,
    t: float | None,
    dtype: str,
    pattern: str | None,
    map_name: str | None,
    map_params: tuple[str, ...],
    like_input: bool,
    no_verify: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Merge fine-tunes of one base model, one tensor at a time, into one weights file.

    BASE and MODELs are files or directories of any layout ckpttool reads (their weights, as
    convert takes them), holding the same tensors in the same shapes. Each floating tensor is
    read in float64 from every input, merged with mergekit's formula for --method, and rounded
    once to the base's dtype (or --dtype): linear (sum w_i x_i / sum w_i over BASE and the
    MODELs), task-arithmetic (BASE + lambda * sum w_i (MODEL_i - BASE)), ties (each task vector
    trimmed to its top --density by magnitude, the sign elected by total mass, the agreeing
    entries averaged) or slerp (BASE and one MODEL, --t). Integer and bool tensors must be
    equal everywhere. A missing tensor or another shape is refused by name (exit 2, nothing
    written). --filter picks BASE's tensors; --map maps each MODEL's names into BASE's (as
    convert's --map). OUT is written atomically and read back; --like-input writes it in
    BASE's own layout (a resume file keeps its other entries). Memory: about (inputs + 2)
    float64 copies of the largest tensor for ties, 2 for the others (--jobs N: N times that).
    PEFT LoRA adapters (BASE and every MODEL): linear and task-arithmetic write one adapter
    directory of summed rank whose delta is the merge of theirs; ties and slerp are refused
    (lora merge each into its base first).

    \b
    Examples:
      ckpttool merge base/ chat/ code/ -o mix.safetensors --method linear --weights 0,1,1
      ckpttool merge base/ chat/ code/ -o ta.safetensors --method task-arithmetic --lambda 0.8
      ckpttool merge base/ chat/ code/ -o ties.safetensors --method ties --density 0.5
      ckpttool merge base/ chat/ -o half.safetensors --method slerp --t 0.5 --json
      ckpttool merge llama-hf/ tuned.gguf -o mix.safetensors --method linear --map llama-gguf-to-hf
    """
    from ckpttool.commands.merge import merge
    from ckpttool.io.progress import Progress
    from ckpttool.render import merge as merge_render

    parsed = _weights(weights)
    with Progress(0, "merge") as bar:
        report = merge(
            base, models, output, method=method, weights=parsed, lam=lam, density=density, t=t,
            dtype=dtype, pattern=pattern, map_name=map_name, map_params=_int_params(map_params),
            like_input=like_input, force=force, verify=not no_verify, progress=bar.advance,
            on_total=lambda n: setattr(bar, "total", max(n, 1)),
        )  # fmt: skip
    if as_json:
        _echo_json(merge_render.render_json(report))
    else:
        click.echo(merge_render.render_text(report))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)


@cli.group("lora", cls=CkptGroup)
def lora_group() -> None:
    """LoRA adapters: merge a PEFT adapter into its base model, or extract one from a fine-tune.

    \b
    Examples:
      ckpttool lora merge llama-7b/ output/checkpoint-500/ -o llama-7b-tuned/
      ckpttool lora extract llama-7b/ llama-7b-tuned/ --rank 16 -o my-adapter/
    """


@lora_group.command("merge")
@click.argument("base", type=click.Path(path_type=str))
@click.argument("adapter", type=click.Path(path_type=str))
@click.option(
    "-o", "--output", "output", metavar="OUT", required=True, type=click.Path(path_type=str),
    help="Where the merged model goes: a model directory for a model directory BASE, else a "
    "file of BASE's format.",
)  # fmt: skip
@written_output_options
@force_option
@json_option("lora-merge")
def lora_merge_command(
    base: str,
    adapter: str,
    output: str,
    max_shard_size: str | None,
    no_verify: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Merge a LoRA adapter into its base: W + scaling * B @ A, one tensor at a time.

    ADAPTER is a PEFT adapter directory (adapter_config.json and adapter_model.safetensors or
    .bin, or a Trainer checkpoint-N/ holding them); BASE is the model it was trained on: a
    Hugging Face model directory, a safetensors file or a .pth state dict. Each adapted weight
    is computed in float32 and rounded back to its dtype once (fan_in_fan_out, rsLoRA,
    rank/alpha patterns and DoRA as PEFT merges them); modules_to_save copies replace the
    base's tensors; every other tensor is copied as stored. No model class, no GPU: memory
    holds a few tensors at a time. OUT keeps BASE's layout (a model directory gets its
    config.json and generation_config.json copied) and is written atomically and read back
    before it appears. A target BASE does not hold, a tied weight the adapter changes, or
    factors whose ranks do not fit are refused (exit 2, nothing written).

    \b
    Examples:
      ckpttool lora merge llama-7b/ output/checkpoint-500/ -o llama-7b-tuned/
      ckpttool lora merge model.safetensors my-adapter/ -o merged.safetensors
      ckpttool lora merge llama-70b/ my-adapter/ -o merged/ --max-shard-size 5GB
    """
    from ckpttool.commands.lora.merge import merge_adapter
    from ckpttool.io.progress import Progress
    from ckpttool.render import lora as lora_render

    with Progress(0, "merge") as bar:
        report = merge_adapter(
            base, adapter, output, force=force, verify=not no_verify,
            max_shard_size=max_shard_size, progress=bar.advance,
            on_total=lambda n: setattr(bar, "total", max(n, 1)),
        )  # fmt: skip
    if as_json:
        _echo_json(lora_render.render_json(report))
    else:
        click.echo(lora_render.render_text(report))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)


@lora_group.command("extract")
@click.argument("base", type=click.Path(path_type=str))
@click.argument("tuned", type=click.Path(path_type=str))
@click.option("--rank", "rank", type=int, required=True, help="The rank R of each LoRA factor.")
@click.option(
    "-o", "--output", "output", metavar="ADAPTER_DIR", required=True,
    type=click.Path(path_type=str), help="The PEFT adapter directory to write.",
)  # fmt: skip
@click.option(
    "--strict", is_flag=True,
    help="Refuse a difference no LoRA holds (a bias, a norm) instead of saving its module whole.",
)  # fmt: skip
@click.option(
    "--task-type", "task_type", metavar="TYPE",
    help="adapter_config.json's task_type: CAUSAL_LM, SEQ_2_SEQ_LM, SEQ_CLS, TOKEN_CLS, "
    "QUESTION_ANS or FEATURE_EXTRACTION (default: from BASE's config.json architectures).",
)  # fmt: skip
@force_option
@json_option("lora-extract")
def lora_extract_command(
    base: str,
    tuned: str,
    rank: int,
    output: str,
    strict: bool,
    task_type: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Extract a LoRA adapter from a fine-tune: TUNED - BASE at rank R, by truncated SVD.

    For each 2-D weight that differs, the difference is factorised (torch.linalg.svd, or
    svd_lowrank for large matrices) into lora_B [out, R] and lora_A [R, in] with scale 1, and
    the fraction of its energy (squared singular values) the rank keeps is reported. A differing
    tensor that is not a 2-D weight (a bias, a norm) puts its module in modules_to_save, saved
    whole from TUNED (--strict refuses it). ADAPTER_DIR is a PEFT adapter directory that
    PeftModel.from_pretrained loads and lora merge merges back, written all or nothing. Its
    task_type comes from BASE's config.json architectures (or --task-type; none found: a note),
    so AutoPeftModelForCausalLM & co load it too; base_model_name_or_path is BASE's absolute
    path when BASE is local.

    \b
    Examples:
      ckpttool lora extract llama-7b/ llama-7b-tuned/ --rank 16 -o my-adapter/
    """
    from ckpttool.commands.lora.extract import extract_adapter
    from ckpttool.render import lora as lora_render

    report = extract_adapter(
        base, tuned, output, rank=rank, strict=strict, force=force, task_type=task_type
    )
    if as_json:
        _echo_json(lora_render.render_extract_json(report))
    else:
        click.echo(lora_render.render_extract_text(report))
    for note in report.notes:
        click.echo(f"note: {note}", err=True)


@cli.command("repair")
@click.argument("src", type=click.Path(path_type=str))
@click.option(
    "-o", "--output", "dst", metavar="DST", type=click.Path(path_type=str),
    help="Where a file's repaired copy goes (default: NAME.repaired.EXT beside SRC).",
)  # fmt: skip
@click.option(
    "--fill-from", metavar="OTHER", type=click.Path(path_type=str),
    help="Take the lost tensors from OTHER (the run's previous checkpoint) where their dtype "
    "and shape match.",
)  # fmt: skip
@click.option(
    "--dry-run", is_flag=True, help="Report what is damaged and recoverable; write nothing."
)
@click.option(
    "--quarantine", is_flag=True,
    help="Run directory: move incomplete checkpoints aside (NAME.incomplete) so resuming "
    "picks the newest complete one.",
)  # fmt: skip
@click.option(
    "--clean", is_flag=True, help="Remove temp files left by interrupted saves (always listed)."
)
@force_option
@json_option("repair")
def repair_command(
    src: str,
    dst: str | None,
    fill_from: str | None,
    dry_run: bool,
    quarantine: bool,
    clean: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Recover what a damaged checkpoint still holds.

    A file cut short (preempted job, full disk, interrupted download) or with a torn record:
    every tensor whose bytes are present and check out (CRC-32 in a torch zip, extents always)
    is written, with the non-tensor fields, to a checkpoint of the same format beside SRC
    (SRC is never changed), read back and compared with SRC's bytes. A lost tensor is listed
    by key, dtype and shape; --fill-from takes it from another checkpoint.

    A directory: a Hugging Face model directory gets its *.index.json rebuilt from the shards;
    a run directory (Trainer output_dir, DeepSpeed save dir, resume files) gets its newest
    complete checkpoint named and DeepSpeed's `latest` pointed at it (--quarantine moves
    incomplete ones aside); leftover temp files are listed (--clean removes them).

    Exit 0 when nothing is lost (SRC intact, or all of it recovered), 1 when something stays
    lost or damaged (tensors lost, --dry-run, damage left as it is, marked "(stays)": a
    directory's lost tensors stay named in its index, or the output failed its read-back and
    was removed), 2 on an error (nothing recoverable, bad input: nothing written).

    \b
    Examples:
      ckpttool repair checkpoints/pretrain_768_resume.pth --dry-run
      ckpttool repair checkpoints/pretrain_768_resume.pth -o resume_fixed.pth
      ckpttool repair cut.pth --fill-from checkpoints/previous_resume.pth
      ckpttool repair llama-7b/                 # rebuild model.safetensors.index.json
      ckpttool repair output/ --quarantine      # resume from the newest complete checkpoint
    """
    from ckpttool.commands.repair import repair
    from ckpttool.render import repair as repair_render

    report = repair(
        src, dst, fill_from=fill_from, dry_run=dry_run, overwrite=force,
        quarantine=quarantine, clean=clean,
    )  # fmt: skip
    if as_json:
        _echo_json(repair_render.render_json(report))
    else:
        click.echo(repair_render.render_text(report))
    sys.exit(report.exit_code)


@cli.command("edit")
@click.argument("src", type=click.Path(path_type=str))
@click.option(
    "-o", "--output", "dst", metavar="DST", type=click.Path(path_type=str),
    help="Where the edited file goes (default: NAME.edited.EXT beside SRC; for a directory, "
    "NAME.edited).",
)  # fmt: skip
@click.option("--in-place", is_flag=True, help="Replace SRC itself, atomically.")
@click.option(
    "--backup",
    is_flag=True,
    help="With --in-place: keep the original as SRC.bak (never overwritten; one an "
    "interrupted run left, the same bytes as SRC, is replaced).",
)
@click.option(
    "--drop", multiple=True, metavar="PATTERN",
    help="Leave out the entries whose key matches (a glob: 'optimizer', 'model.lm_head.*'); "
    "repeatable. A pattern (as for --keep, --rename) that matches no key is an error.",
)  # fmt: skip
@click.option(
    "--keep", multiple=True, metavar="PATTERN",
    help="Keep only the tensors whose key matches one of these globs (other values stay).",
)  # fmt: skip
@click.option(
    "--rename", multiple=True, metavar="REGEX=REPLACEMENT",
    help="Rename tensors whose key matches (re.sub, \\1 for groups); repeatable, in order.",
)  # fmt: skip
@click.option(
    "--for-inference", is_flag=True,
    help="Drop what only resuming training needs (the optimizer, scaler, scheduler, RNG "
    "states, by name or found by their structure at any key; a Lightning .ckpt's "
    "optimizer_states and lr_schedulers).",
)  # fmt: skip
@use_ema_option
@map_options("the model's names and layout", "beside SRC")
@click.option(
    "--dtype", type=click.Choice(["fp16", "bf16", "fp32"]),
    help="Cast the floating weights, on a file and on a directory alike (integer and float8 "
    "tensors, step counters and an optimizer's state are never cast; values that become 0 "
    "are reported).",
)  # fmt: skip
@click.option(
    "--keep-dtype", multiple=True, metavar="PATTERN",
    help="With --dtype: leave the tensors whose key matches alone (norms, routers); repeatable.",
)  # fmt: skip
@click.option("--allow-overflow", is_flag=True, help="With --dtype: write values too large as inf.")
@click.option(
    "--cast-optimizer", is_flag=True,
    help="With --dtype: cast the optimizer's state too (its step counters never); a resumed "
    "run then continues from the cast state.",
)  # fmt: skip
@click.option(
    "--compact", is_flag=True,
    help="Cut every storage to the bytes its tensors view (a view saved whole keeps only its "
    "own bytes).",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print what would change; write nothing.")
@force_option
@json_option("edit")
@edit_jobs_option
@on_ranks
def edit_command(
    src: str,
    dst: str | None,
    in_place: bool,
    backup: bool,
    drop: tuple[str, ...],
    keep: tuple[str, ...],
    rename: tuple[str, ...],
    for_inference: bool,
    use_ema: str | None,
    map_name: str | None,
    map_params: tuple[str, ...],
    dtype: str | None,
    keep_dtype: tuple[str, ...],
    allow_overflow: bool,
    cast_optimizer: bool,
    compact: bool,
    dry_run: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Rewrite a checkpoint file or directory in its own format with entries dropped, kept or
    renamed.

    The edits run in this order: --use-ema, --for-inference, --drop, --keep, --rename,
    --map, --dtype, --compact. The result keeps SRC's format and layout (a resume file stays
    a resume file, a Lightning .ckpt stays loadable by Lightning, a DCP directory stays DCP),
    every tensor the same view of the same bytes; storages are copied whole (in the kernel
    for a torch zip), those no kept tensor views are not written. It is
    written atomically and read back before it replaces anything. A damaged file is refused
    (ckpttool repair is for it).

    \b
    Examples:
      ckpttool edit checkpoints/pretrain_768_resume.pth --for-inference -o pretrain_768_inf.pth
      ckpttool edit last.ckpt --for-inference --in-place --backup
      ckpttool edit model.pth --drop 'lm_head.*' --rename '^model\\.=' --dry-run
      ckpttool edit ddp.pth --rename '^module\\.=' -o plain.pth
      ckpttool edit model.pth --dtype bf16 --keep-dtype '*norm*' -o model_bf16.pth
      ckpttool edit last.pth --use-ema --for-inference -o ema_weights.pth
      ckpttool edit consolidated.pth --map llama-meta-to-hf -o hf_names.pth
      ckpttool edit sliced.pth --compact -o small.pth
      ckpttool edit output/checkpoint-500 --for-inference -o model_dir
      ckpttool edit dcp/step_1200 --for-inference --dtype bf16 -o step_1200_bf16
    """
    from ckpttool.commands.edit_directory import edit
    from ckpttool.render import edit as edit_render

    report = lead_result(lambda: edit(
        src, dst, drop=drop, keep=keep, rename=rename, for_inference=for_inference,
        use_ema=use_ema, map_name=map_name, map_params=_int_params(map_params), compact=compact, dtype=dtype, keep_dtype=keep_dtype, allow_overflow=allow_overflow,
        cast_optimizer=cast_optimizer, in_place=in_place, backup=backup, dry_run=dry_run, overwrite=force,
    ))  # fmt: skip
    if as_json:
        _echo_json(edit_render.render_json(report))
    else:
        click.echo(edit_render.render_text(report))


def _weights(text: str | None) -> list[float] | None:
    """``--weights 1,2,0.5`` as numbers (average and merge)."""
    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise InputError(f"--weights takes numbers separated by commas; got {text!r}") from None


def _int_params(pairs: tuple[str, ...]) -> dict[str, int]:
    """``--map-param NAME=N`` pairs as a dict (a bad one is a usage error)."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value.isdigit():
            raise InputError(f"--map-param {pair!r}: expected NAME=N (a positive integer)")
        params[name] = int(value)
    return params


@cli.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--values", is_flag=True, help="Also read every floating tensor: NaN/Inf.")
@component_option
@json_option("verify")
@remote_options
@jobs_option
@on_ranks
def verify_command(
    paths: tuple[str, ...], values: bool, component: str | None, as_json: bool
) -> None:
    """Check files' integrity without trusting them.

    Zip structure (central directory vs local headers, CRC-32 of every record, duplicate
    names, truncation), every storage's size against the pickle's claims, every tensor's
    extent, safetensors header rules, legacy storage sizes; for a torch.distributed.checkpoint
    directory, every rank file present and of the right size and every chunk's archive; temp
    files left next to the file by an interrupted save, or anywhere in a directory, and stray
    NAME.bak backups. In a model directory, files named like checkpoints that it does not
    load (a pytorch_model.bin beside model.safetensors) are verified too.

    Each path gets its own verdict and the run goes on: a path that cannot be checked at all
    (missing, unreadable) gets an "Error: PATH: ..." line on stderr; a file that is there but
    is no checkpoint (empty, torn, unrecognised) is a problem. A directory that is no
    checkpoint layout, or a Trainer output_dir, is walked: each checkpoint in it gets its
    verdict. --component NAME checks
    only that part's files of a multi-component folder (a pipeline's unet). Exit 0 when every
    path was checked and is clean, 1 when a problem (or a leftover temp file) was found in any
    (this wins), 2 when some path could not be checked. --json always prints the JSON report.

    \b
    Examples:
      ckpttool verify checkpoints/pretrain_768_resume.pth
      ckpttool verify out/*.pth --values --json
      ckpttool verify checkpoints/step_1200/
      ckpttool verify pipeline/ --component unet
    """
    from ckpttool.commands.verify import verify, verify_exit_code
    from ckpttool.io.progress import Progress
    from ckpttool.render import verify as verify_render

    total = sum(_input_bytes(p) for p in paths)
    with Progress(total, "verify") as bar:
        results = verify(paths, values=values, progress=bar.advance, component=component)
    if as_json:
        _echo_json(verify_render.render_json(results))
    else:
        report = verify_render.render_text(results)
        if report:
            click.echo(report)
    for result in results:
        if result.error is not None:
            click.echo(f"Error: {result.path}: {' '.join(result.error.split())}", err=True)
    sys.exit(verify_exit_code(results))


@cli.command("scan")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option(
    "--allow", multiple=True, metavar="MODULE.NAME",
    help="Accept this global (e.g. a config class you trust); repeatable.",
)  # fmt: skip
@json_option("scan")
@remote_options
@scan_jobs_option
@on_ranks
def scan_command(paths: tuple[str, ...], allow: tuple[str, ...], as_json: bool) -> None:
    """List every global the pickles reference, classed safe / unknown / dangerous.

    Runs nothing: the pickle is walked by ckpttool's own reader. A global is judged by what
    the pickle does with it: a call of anything not known to be inert is dangerous, a class
    only named or built by pickle's default mechanism unknown. Directories are scanned
    recursively (only files that positively are not pickles, such as text, JSON or images,
    are skipped). Each path is scanned on its own. A gzip, bzip2, xz or tar archive is opened
    and each file in it scanned; a 7z, RAR or zstd archive is a finding ("archive not
    scanned").
    Exit 0 when only safe data constructs are referenced, 1 when something unknown or
    dangerous is (this wins over 2), 2 when a path could not be scanned (missing, not a
    checkpoint, unreadable) or a directory holds no checkpoint: scanning nothing is not clean.

    \b
    Examples:
      ckpttool scan downloaded_model.pth
      ckpttool scan checkpoints/ --allow mypackage.TrainConfig
    """
    from ckpttool.commands.scan import scan
    from ckpttool.errors import EXIT_FOUND
    from ckpttool.render import scan as scan_render

    report = scan(paths, allow)
    if as_json:
        _echo_json(scan_render.render_json(report))
    else:
        click.echo(scan_render.render_text(report))
    if report.found:
        sys.exit(EXIT_FOUND)
    if report.failed:
        sys.exit(EXIT_ERROR)
