"""Every command's renderer in ckpttool.render has the same two functions: one contract."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import ckpttool.render

HELPERS = {"text", "show_deepspeed"}  # helpers (shared text; show's DeepSpeed lines), not renderers


def test_every_renderer_has_render_text_and_render_json() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(ckpttool.render.__path__))
    assert {"show", "show_tree", "diff", "convert", "rescale", "verify", "scan"} <= set(names)
    for name in names:
        if name in HELPERS:
            continue
        module = importlib.import_module(f"ckpttool.render.{name}")
        for function in ("render_text", "render_json"):
            assert inspect.isfunction(getattr(module, function, None)), f"{name}.{function}"
        # the report comes first, positionally; anything else is a keyword option
        text_params = list(inspect.signature(module.render_text).parameters.values())
        assert all(p.default is not p.empty for p in text_params[1:]), name
        assert len(inspect.signature(module.render_json).parameters) == 1, name
