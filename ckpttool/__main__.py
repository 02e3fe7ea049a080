"""``python -m ckpttool``: the command line."""

from ckpttool.cli import main

main()
