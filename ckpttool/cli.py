"""The command line: a thin click layer over the library.

Each command parses its options, calls one library function, renders the result, and turns a
:class:`~ckpttool.errors.CkptError` into a one-line ``Error: ...`` and its exit code.
"""

from __future__ import annotations

import sys

import click

from ckpttool import __version__
from ckpttool.errors import EXIT_ERROR, CkptError

EXIT_CODES_HELP = """\b
Exit codes:
  0  success (diff: no differences; verify/scan: nothing found)
  1  diff: the checkpoints differ; verify/scan: a problem was found;
     convert: the written file failed verification (it was removed)
  2  error: missing/unreadable/corrupt/unsafe input, bad usage"""


class CkptGroup(click.Group):
    """A click group that turns library errors into one line on stderr and an exit code."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except CkptError as error:
            click.echo(f"Error: {error}", err=True)
            sys.exit(error.exit_code)
        except MemoryError:
            click.echo("Error: out of memory while reading the file", err=True)
            sys.exit(EXIT_ERROR)


@click.group(cls=CkptGroup, help="Inspect, compare, convert and repair PyTorch checkpoints.\n\n" + EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="ckpttool")
def cli() -> None:
    pass


def main() -> None:
    cli(prog_name="ckpttool")
