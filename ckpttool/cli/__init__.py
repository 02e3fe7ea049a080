"""The command line: the click group (:mod:`ckpttool.cli.app`) and the options its commands share."""

from ckpttool.cli.app import cli, main

__all__ = ["cli", "main"]
