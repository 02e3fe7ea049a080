"""Rendering of every command's report, for people and for scripts; no library logic here.

One module per command (``show``, ``show_tree`` for ``show --tree``, ``diff``, ``convert``,
``rescale``, ``verify``, ``scan``), each with the same two functions:

- ``render_text(report, **options) -> str``: what the command prints on stdout;
- ``render_json(report) -> dict``: what ``--json`` prints (``show --tree --json``: the tree's
  JSON value), with the schema in ``docs/schemas/``.

General text helpers (sizes, counts, short values) are in :mod:`ckpttool.render.text`; the
text of ``--json`` output is written by :mod:`ckpttool.render.json_text`. Nothing
is imported here, so a command loads only its own renderer; tabulate is imported only where a
table is printed.
"""
