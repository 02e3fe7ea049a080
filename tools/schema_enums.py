"""Write the format and layout names (ckpttool/model/vocabulary.py) into docs/schemas/*.json.

    python -m tools.schema_enums            # from the repository root: rewrite the schemas
    python -m tools.schema_enums --check    # exit 1 if a schema's names are not the table's

Each schema that names a checkpoint's format or layout refers to its own ``$defs/format`` and
``$defs/layout`` (``{"$ref": "#/$defs/format"}``); this writes those two enums from the one
table in the code, so every command's schema accepts the same names. ``tests/test_docs.py``
runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ckpttool.model.vocabulary import FORMATS, LAYOUTS

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "docs" / "schemas"
REGENERATE = "python -m tools.schema_enums"
#: The schemas that name a checkpoint's format or layout (convert's own ``format`` is the
#: output's, safetensors or pth, and stays in its schema).
NAMED = ("show", "diff", "convert", "rescale-step", "verify", "scan", "repair", "edit")


def definitions() -> dict[str, Any]:
    """The ``$defs`` entries this writes."""
    return {
        "format": {
            "enum": list(FORMATS),
            "description": f"how the checkpoint is stored (ckpttool/model/vocabulary.py; {REGENERATE})",
        },
        "layout": {
            "enum": list(LAYOUTS),
            "description": f"what the checkpoint holds (ckpttool/model/vocabulary.py; {REGENERATE})",
        },
    }


def uses(schema: Any, name: str) -> bool:
    """Whether ``schema`` refers to ``#/$defs/<name>`` anywhere."""
    if isinstance(schema, dict):
        if schema.get("$ref") == f"#/$defs/{name}":
            return True
        return any(uses(value, name) for value in schema.values())
    if isinstance(schema, list):
        return any(uses(item, name) for item in schema)
    return False


def render(command: str) -> str:
    """The text of ``docs/schemas/<command>.schema.json`` with its name enums current."""
    path = SCHEMAS / f"{command}.schema.json"
    schema = json.loads(path.read_text())
    defs = schema.setdefault("$defs", {})
    for name, definition in definitions().items():
        if uses(schema, name):
            defs[name] = definition
        else:
            defs.pop(name, None)
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a schema is stale")
    args = parser.parse_args(argv)
    stale = []
    for command in NAMED:
        path = SCHEMAS / f"{command}.schema.json"
        text = render(command)
        if path.read_text() != text:
            stale.append(path.name)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run `{REGENERATE}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
