"""``python -m ckpttool``: the command line."""

from ckpttool.cli import main

if __name__ == "__main__":  # not when a --jobs worker process imports it
    main()
