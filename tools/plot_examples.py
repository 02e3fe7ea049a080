"""The example pictures in docs/diff.md and docs/trend.md, drawn from committed fixtures:
``python -m tools.plot_examples`` (needs the ``plot`` extra).

- docs/images/diff_by_module.png: ``ckpttool diff`` of the Trainer fixture's checkpoint-4 and
  checkpoint-8 (tests/fixtures/frameworks/trainer_1proc/output), their models, ``--plot``;
- docs/images/trend.png: ``ckpttool trend`` of the same output_dir, ``--plot``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from ckpttool.cli import cli

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_DIR = ROOT / "tests" / "fixtures" / "frameworks" / "trainer_1proc" / "output"
IMAGES = ROOT / "docs" / "images"


def main() -> int:
    IMAGES.mkdir(exist_ok=True)
    runs = [
        ["diff", str(OUTPUT_DIR / "checkpoint-4"), str(OUTPUT_DIR / "checkpoint-8"),
         "--section", "model", "--top", "12", "--plot", str(IMAGES / "diff_by_module.png")],
        ["trend", str(OUTPUT_DIR), "--plot", str(IMAGES / "trend.png")],
    ]  # fmt: skip
    for args in runs:
        result = CliRunner().invoke(cli, args)
        if result.exit_code not in (0, 1):
            print(result.output, file=sys.stderr)
            return 2
        print(f"wrote {args[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
