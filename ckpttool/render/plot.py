"""``diff --plot FILE`` and ``trend --plot FILE``: the pictures people draw in notebooks.

matplotlib is an optional extra (``pip install 'ckpttool[plot]'``), imported only here and only
when a plot is asked for; the Agg backend is used (no display needed). The file's suffix picks
the format (``.png`` or ``.svg``). The functions return the figure, so that a test can check
the data it plots against the ``--json`` numbers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.commands.diff.modules import ModuleChange, module_groups
from ckpttool.commands.diff.run import DiffReport, TensorDiff
from ckpttool.commands.trend import TrendReport
from ckpttool.errors import InputError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SUFFIXES = (".png", ".svg")
DPI = 100
TOP_DEFAULT = 20  # tensors in diff's bar chart when --top is not given
CHANGE_LABEL = "relative change ‖B − A‖ / ‖A‖"


def pyplot(path: str) -> Any:
    """matplotlib.pyplot on the Agg backend; an error naming the extra when it is missing
    (and one for a suffix other than .png or .svg): called before any work is done."""
    if Path(path).suffix.lower() not in SUFFIXES:
        raise InputError(f"{path}: --plot writes .png or .svg (by the file's suffix)")
    try:
        import matplotlib
    except ImportError:
        raise InputError(f"{path}: --plot needs matplotlib: pip install 'ckpttool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def layer_cells(report: DiffReport) -> tuple[list[int], list[str], list[list[float]]]:
    """The heatmap's data: layers (a key's first block number in a stack of repeated blocks,
    :meth:`ckpttool.model.modules.ModuleGroups.stack`: numbered modules that repeat no
    structure are no layers), module kinds (the key's group after that number:
    ``mlp.up_proj``), and per cell the parameter-weighted relative change of its tensors (NaN
    where a layer has no such module or nothing was measured)."""
    sums: dict[tuple[int, str], list[float]] = {}
    kinds: list[str] = []
    groups = module_groups(report)
    for entry in report.tensors:
        values = entry.values
        if values is None or not values.measured:
            continue
        stack = groups.stack(entry.key)
        if stack is None:
            continue
        layer, kind = stack.layer, stack.kind
        if kind not in kinds:
            kinds.append(kind)
        cell = sums.setdefault((layer, kind), [0.0, 0.0])
        cell[0] += values.sum_sq_diff
        cell[1] += values.sum_sq_a
    layers = sorted({layer for layer, _ in sums})
    grid = [
        [_ratio(*sums[(layer, kind)]) if (layer, kind) in sums else math.nan for kind in kinds]
        for layer in layers
    ]
    return layers, kinds, grid


def _ratio(diff_sq: float, norm_sq: float) -> float:
    if diff_sq == 0:
        return 0.0
    return math.sqrt(diff_sq / norm_sq) if norm_sq > 0 else math.inf


def diff_figure(
    report: DiffReport, modules: list[ModuleChange], top: list[TensorDiff], path: str
) -> Figure:
    """Left: relative change per layer x module kind (a heatmap; without a stack of repeated
    blocks, a bar per module group). Right: the most changed tensors."""
    plt = pyplot(path)
    import numpy as np

    layers, kinds, grid = layer_cells(report)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, max(4.0, 0.3 * max(len(layers), len(top), 8))), dpi=DPI,
        gridspec_kw={"width_ratios": [1.2, 1]},
    )  # fmt: skip
    if layers:
        data = np.ma.masked_invalid(np.array(grid, dtype=np.float64))
        image = left.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
        left.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right", fontsize=8)
        left.set_yticks(range(len(layers)), [str(n) for n in layers], fontsize=8)
        left.set_xlabel("module")
        left.set_ylabel("layer (block number)")
        left.set_title("Relative change per layer and module")
        fig.colorbar(image, ax=left, label=CHANGE_LABEL)
    else:
        names = [g.group for g in modules]
        heights = [_finite(g.relative_change) for g in modules]
        left.barh(range(len(names)), heights, color="tab:blue")
        left.set_yticks(range(len(names)), names, fontsize=8)
        left.invert_yaxis()
        left.set_xlabel(CHANGE_LABEL)
        left.set_title("Relative change per module group")
    keys = [entry.key for entry in top]
    heights = [_finite(entry.values.relative_change if entry.values else None) for entry in top]
    right.barh(range(len(keys)), heights, color="tab:orange")
    right.set_yticks(range(len(keys)), keys, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel(CHANGE_LABEL)
    right.set_title(f"The {len(keys)} most changed tensors")
    fig.suptitle(f"{Path(report.a.path).name} → {Path(report.b.path).name}")
    fig.tight_layout()
    return fig


def _finite(value: float | None) -> float:
    return 0.0 if value is None or not math.isfinite(value) else value


def trend_figure(report: TrendReport, path: str) -> Figure:
    """Top: each module group's norm over the run; bottom: its relative update (log scale);
    a red line at the first checkpoint holding a NaN or an Inf."""
    plt = pyplot(path)

    points = report.checkpoints
    steps = all(p.step is not None for p in points) and report.order == "step"
    xs = [p.step if steps else i for i, p in enumerate(points)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), dpi=DPI, sharex=True)
    for group in report.groups:
        top.plot(xs, [_nan(v) for v in group.norms], marker="o", label=group.group)
        bottom.plot(xs[1:], [_nan(v) for v in group.relative_updates[1:]], marker="o", label=group.group)  # fmt: skip
    top.set_ylabel("norm ‖W‖")
    top.set_title("Norm per module group")
    bottom.set_ylabel("relative update ‖W_i − W_(i−1)‖ / ‖W_(i−1)‖")
    bottom.set_title("Update size per module group")
    if any(v > 0 for g in report.groups for v in map(_nan, g.relative_updates[1:]) if v == v):
        bottom.set_yscale("log")
    bottom.set_xlabel("step" if steps else "checkpoint")
    if report.first_nonfinite is not None:
        where = xs[report.first_nonfinite]
        for axes in (top, bottom):
            axes.axvline(where, color="red", linestyle="--", label="first NaN/Inf")
    handles, labels = top.get_legend_handles_labels()
    if len(labels) <= 20:
        top.legend(handles, labels, fontsize=7, loc="best")
    fig.suptitle(f"{len(points)} checkpoints")
    fig.tight_layout()
    return fig


def _nan(value: float | None) -> float:
    return math.nan if value is None or not math.isfinite(value) else value


def save(fig: Figure, path: str) -> None:
    """Write the figure (format by suffix) atomically."""
    import io

    from ckpttool.io.atomic import atomic_write

    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lower().lstrip("."), dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
    with atomic_write(path) as out:
        out.write(buffer.getvalue())
