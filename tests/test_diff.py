"""The diff library: every kind of difference on generated pairs, value semantics, streaming."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpttool.checkpoint import Checkpoint, open_checkpoint
from ckpttool.commands.diff import values as diff_values
from ckpttool.commands.diff.run import (
    DIFFER,
    EQUAL_AFTER_ROUNDING,
    IDENTICAL,
    ONLY_A,
    ONLY_B,
    WITHIN_TOLERANCE,
    Alias,
    DiffReport,
    FieldDiff,
    TensorDiff,
    diff,
    plan_diff,
    run_diff,
)
from ckpttool.commands.diff.values import compare_dtype
from ckpttool.errors import InputError, NotACheckpointError
from tests.fixtures.pairs import CHANGED_INDEX, CHANGED_TENSOR, NAN_TENSOR, TIED
from tests.support.helpers import FIXTURES, fixture_files, fixture_id

PAIRS = FIXTURES / "pairs"
BASE = PAIRS / "base.pth"
NUM_BASE = 12  # tensors in NANO's state dict


def by_key(report: DiffReport) -> dict[str, TensorDiff]:
    return {entry.key: entry for entry in report.tensors}


def not_identical(report: DiffReport) -> dict[str, str]:
    return {e.key: e.status for e in report.tensors if e.status != IDENTICAL}


def counts(
    identical: int = 0, within: int = 0, differ: int = 0, a: int = 0, b: int = 0, rounded: int = 0
) -> dict:
    return {
        IDENTICAL: identical, WITHIN_TOLERANCE: within, DIFFER: differ, ONLY_A: a, ONLY_B: b,
        EQUAL_AFTER_ROUNDING: rounded,
    }  # fmt: skip


@pytest.mark.parametrize("path", fixture_files(), ids=fixture_id)
def test_every_fixture_is_identical_to_itself(path: Path) -> None:
    """Views, NumPy arrays, bf16, cuda-tagged and legacy storages all take the values path.
    A ZeRO-3 rank's model states (``zero_pp_rank_*_model_states.pt``) holds 0-element
    placeholders: refused, not "identical" (tests/test_deepspeed_placeholders.py)."""
    if path.name.startswith("zero_pp_rank_") and path.name.endswith("_model_states.pt"):
        with pytest.raises(InputError, match="hold 0 elements standing for the real ones"):
            diff(path, path)
        return
    report = diff(path, path)
    assert report.equal and report.fields == []
    assert report.counts() == counts(identical=len(report.tensors)) and report.tensors
    assert all(e.values is not None and e.values.bitwise_equal for e in report.tensors)


# --- the same model in every format ---------------------------------------------------------


@pytest.mark.parametrize(
    ("other", "alias"),
    [
        ("base_legacy.pth", None),
        ("base.safetensors", Alias("b", TIED[1], "metadata")),  # save_model's metadata
        ("base_nometa.safetensors", Alias("b", TIED[1], "shared_storage")),  # HF style
    ],
)
def test_same_model_in_every_format_has_no_differences(other: str, alias: Alias | None) -> None:
    for a, b in ((BASE, PAIRS / other), (PAIRS / other, BASE)):
        report = diff(a, b)
        assert report.equal, not_identical(report)
        assert report.counts() == counts(identical=NUM_BASE)
        assert report.fields == []
        tied = by_key(report)[TIED[0]]
        if alias is None:
            assert tied.alias is None
        elif a == BASE:
            assert tied.alias == alias
            assert tied.b is not None and tied.b.key == TIED[1]
        else:
            assert tied.alias == Alias("a", TIED[1], alias.rule)


def test_convert_alias_metadata_resolves_untied_copies() -> None:
    report = diff(PAIRS / "base_untied.pth", PAIRS / "base_aliases.safetensors")
    assert report.equal
    assert by_key(report)[TIED[0]].alias == Alias("b", TIED[1], "metadata")
    assert any("metadata names it an alias" in note for note in report.notes)


def test_separate_copies_are_not_a_tie() -> None:
    """Without metadata, only shared storage is evidence that a missing key is an alias."""
    report = diff(PAIRS / "base_untied.pth", PAIRS / "base_nometa.safetensors")
    assert not report.equal
    assert report.counts() == counts(identical=NUM_BASE - 1, a=1)
    assert by_key(report)[TIED[0]].status == ONLY_A


# --- resume files against weights files -----------------------------------------------------


def test_minimind_resume_model_section_equals_its_weights_file() -> None:
    weights = FIXTURES / "minimind/pretrain_32.pth"
    resume = FIXTURES / "minimind/pretrain_32_resume.pth"
    for a, b, side in ((weights, resume, "b"), (resume, weights, "a")):
        report = diff(a, b)
        assert report.equal and report.counts() == counts(identical=21)
        resume_side = report.b if side == "b" else report.a
        assert resume_side.section == "model" and resume_side.auto_section
        assert report.notes == [
            f"A ({'plain state dict' if side == 'b' else 'MiniMind-style resume checkpoint'}) "
            f"and B ({'MiniMind-style resume checkpoint' if side == 'b' else 'plain state dict'})"
            " are different kinds: comparing "
            + ("all of A with B's 'model' section" if side == "b" else "A's 'model' section with all of B")
            + " (use --section-a/--section-b to choose)",
            f"not compared: {'B' if side == 'b' else 'A'}'s optimizer, epoch, step, world_size, "
            "wandb_id, scaler (outside its 'model' section): the other side holds nothing under "
            "those names",
        ]  # fmt: skip


def test_ckpttool_fp16_weights_against_fp32_resume_model_reports_the_cast() -> None:
    weights = FIXTURES / "ckpttool/pretrain_32.pth"
    resume = FIXTURES / "ckpttool/pretrain_32_resume.pth"
    strict = diff(weights, resume)
    assert not strict.equal
    for entry in strict.tensors:
        assert entry.changes[0] == "dtype float16 -> float32, compared as float32"
        assert entry.values is not None and entry.values.compared_as == "float32"
        assert not entry.values.bitwise_equal
    # fp16 rounding is a relative error of at most 2**-11, far outside rtol=1e-5 ...
    assert strict.counts()[DIFFER] == 21
    # ... and inside rtol=1e-3 (with an atol for the values fp16 stores as subnormals)
    loose = diff(weights, resume, rtol=1e-3, atol=1e-6)
    assert loose.equal and loose.counts() == counts(within=21)


# --- one kind of difference per pair --------------------------------------------------------


def test_fp16_copy_with_exact_values_is_within_tolerance_never_identical() -> None:
    report = diff(BASE, PAIRS / "base_fp16.pth")
    assert report.equal and report.counts() == counts(within=NUM_BASE)
    for entry in report.tensors:
        assert entry.values is not None
        assert entry.values.mismatched == 0 and entry.values.max_abs_diff == 0.0
        assert entry.changes == ("dtype float32 -> float16, compared as float32",)


def test_fp16_copy_of_unrepresentable_values_depends_on_tolerance() -> None:
    a, b = PAIRS / "fine_fp32.pth", PAIRS / "fine_fp16.pth"
    loaded_a, loaded_b = torch.load(a), torch.load(b)
    report = diff(a, b)
    assert report.counts() == counts(differ=2)
    for key, entry in by_key(report).items():
        reference = loaded_b[key].float()
        error = (loaded_a[key] - reference).abs()
        assert entry.values is not None
        assert entry.values.max_abs_diff == pytest.approx(error.max().item(), rel=1e-6)
        assert entry.values.max_rel_diff == pytest.approx(
            (error / reference.abs()).max().item(), rel=1e-6
        )
        assert entry.values.mismatched == entry.values.numel
    assert diff(a, b, rtol=1e-3).counts() == counts(within=2)


def test_one_changed_element() -> None:
    report = diff(BASE, PAIRS / "one_element.pth")
    assert report.counts() == counts(identical=NUM_BASE - 1, differ=1)
    entry = by_key(report)[CHANGED_TENSOR]
    values = entry.values
    assert values is not None and entry.changes == ()
    changed = torch.load(PAIRS / "one_element.pth")[CHANGED_TENSOR][CHANGED_INDEX].item()
    assert (values.mismatched, values.numel) == (1, 128)
    assert values.max_abs_diff == 0.25
    assert values.max_rel_diff == pytest.approx(0.25 / abs(changed))
    assert not values.nan_positions_differ and not values.inf_positions_differ


def test_nan_in_one_tensor() -> None:
    report = diff(BASE, PAIRS / "nan.pth")
    assert not_identical(report) == {NAN_TENSOR: DIFFER}
    entry = by_key(report)[NAN_TENSOR]
    assert entry.values is not None
    assert entry.values.nan_positions_differ and entry.values.mismatched == 1
    assert entry.changes == ("NaN positions differ",)
    assert diff(PAIRS / "nan.pth", PAIRS / "nan.pth").equal  # NaN in the same place: identical


def test_missing_extra_and_reshaped_tensors() -> None:
    report = diff(BASE, PAIRS / "structure.pth")
    assert not_identical(report) == {
        "model.layers.0.mlp.down_proj.weight": ONLY_A,
        NAN_TENSOR: DIFFER,
        "model.extra.bias": ONLY_B,
    }
    reshaped = by_key(report)[NAN_TENSOR]
    assert reshaped.changes == ("shape [8] -> [2, 4]",) and reshaped.values is None
    assert [e.key for e in report.tensors][-1] == "model.extra.bias"  # B's extras last


def test_wrapper_prefixes() -> None:
    ddp = PAIRS / "ddp.pth"
    aligned = diff(ddp, BASE)  # every key of A is B's with module.: aligned, said in a note
    assert aligned.counts() == counts(identical=NUM_BASE) and aligned.a.prefix == "module."
    assert aligned.notes == ["A's tensor keys are B's with the prefix 'module.': compared without it"]  # fmt: skip
    explicit = diff(ddp, BASE, ignore_wrappers=True)
    assert explicit.counts() == counts(identical=NUM_BASE)
    assert explicit.notes == [] and explicit.a.prefix is None
    assert diff(BASE, ddp, strip=["module."]).equal
    report = diff(ddp, BASE, ignore_wrappers=True)
    assert by_key(report)[TIED[0]].a.key == f"module.{TIED[0]}"  # type: ignore[union-attr]


def test_prefix_collision_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "both.pth"
    torch.save({"module.w": torch.zeros(2), "w": torch.ones(2)}, path)
    with pytest.raises(InputError, match="both 'w'"):
        diff(path, BASE, ignore_wrappers=True)


def test_changed_training_fields() -> None:
    report = diff(PAIRS / "resume_a.pth", PAIRS / "resume_b.pth")
    assert report.counts() == counts(identical=16)  # model, optimizer moments and steps
    assert report.fields == [
        FieldDiff("step", "changed", 1200, 2400),
        FieldDiff("world_size", "changed", 8, 4),
        FieldDiff("wandb_id", "changed", "run-a", "run-b"),
        FieldDiff("config.model.dropout", "changed", 0.0, 0.1),
        FieldDiff("optimizer.param_groups.0.lr", "changed", 5e-4, 2.5e-4),
        FieldDiff("scaler.scale", "changed", 65536.0, 32768.0),
    ]
    assert not report.equal
    assert report.a.section is None and not report.notes  # same kind: whole files


def test_lightning_fields_and_section_option() -> None:
    report = diff(PAIRS / "lightning_a.ckpt", PAIRS / "lightning_b.ckpt")
    assert [(f.key, f.a, f.b) for f in report.fields] == [
        ("global_step", 40, 80),
        ("hyper_parameters.optim.lr", 1e-3, 2e-3),
    ]
    only_weights = diff(
        PAIRS / "lightning_a.ckpt", PAIRS / "lightning_b.ckpt", section="state_dict"
    )
    assert only_weights.equal and only_weights.fields == []
    optimizer = diff(PAIRS / "resume_a.pth", PAIRS / "resume_b.pth", section="optimizer")
    assert [f.key for f in optimizer.fields] == ["param_groups.0.lr"]
    assert {e.key for e in optimizer.tensors} >= {"state.0.exp_avg", "state.0.step"}
    with pytest.raises(InputError, match="no section 'nonexistent'"):
        diff(BASE, BASE, section="nonexistent")


def test_field_types_count() -> None:
    from ckpttool.commands.diff.run import compare_fields

    assert compare_fields({"step": 1}, {"step": 1.0}) == [FieldDiff("step", "changed", 1, 1.0)]
    assert compare_fields({"x": float("nan")}, {"x": float("nan")}) == []
    assert compare_fields({"a": {"b": True}}, {}) == [FieldDiff("a.b", "only_a", True, None)]


# --- --quick reads no tensor bytes ----------------------------------------------------------


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Checkpoint, record: Any) -> Any:
        raise AssertionError(f"--quick read the bytes of {record.key}")

    monkeypatch.setattr(Checkpoint, "read_bytes", refuse)


@pytest.mark.usefixtures("no_reads")
def test_quick_reads_no_tensor_bytes() -> None:
    report = diff(BASE, PAIRS / "one_element.pth", quick=True)
    assert report.quick and report.equal  # values are not looked at
    assert all(e.values is None for e in report.tensors)
    fp16 = diff(BASE, PAIRS / "base_fp16.pth", quick=True)
    assert fp16.counts() == counts(differ=NUM_BASE)  # a dtype change is structural here
    assert fp16.tensors[0].changes == ("dtype float32 -> float16",)
    resume = diff(PAIRS / "resume_a.pth", PAIRS / "resume_b.pth", quick=True)
    assert len(resume.fields) == 6 and resume.counts()[IDENTICAL] == 16
    structure = diff(BASE, PAIRS / "structure.pth", quick=True)
    assert structure.counts() == counts(identical=10, differ=1, a=1, b=1)


@pytest.mark.usefixtures("no_reads")
def test_full_diff_does_read(tmp_path: Path) -> None:
    """The monkeypatch above is real: the same call without quick trips it."""
    with pytest.raises(AssertionError, match="read the bytes"):
        diff(BASE, PAIRS / "one_element.pth")


# --- value semantics -------------------------------------------------------------------------


def save_pair(tmp_path: Path, a: Any, b: Any) -> tuple[Path, Path]:
    path_a, path_b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save({"t": a}, path_a)
    torch.save({"t": b}, path_b)
    return path_a, path_b


def one(tmp_path: Path, a: Any, b: Any, **options: Any) -> TensorDiff:
    return diff(*save_pair(tmp_path, a, b), **options).tensors[0]


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("a", "b", "status"),
    [
        ([0.0, 1.0], [-0.0, 1.0], WITHIN_TOLERANCE),  # equal values, different bits
        ([NAN, 1.0], [NAN, 1.0], IDENTICAL),
        ([INF, -INF], [INF, -INF], IDENTICAL),
        ([INF], [-INF], DIFFER),  # |a - b| <= inf must not pass
        ([INF], [1e38], DIFFER),
        ([1.0], [1.0 + 1e-6], WITHIN_TOLERANCE),
        ([1.0], [1.0 + 1e-4], DIFFER),
        ([0.0], [1e-9], WITHIN_TOLERANCE),  # atol
    ],
)
def test_float_verdicts(tmp_path: Path, a: list, b: list, status: str) -> None:
    assert one(tmp_path, torch.tensor(a), torch.tensor(b)).status == status


def test_nan_payloads_are_equal_within_tolerance_only(tmp_path: Path) -> None:
    quiet = torch.tensor([np.float32(np.nan)])
    other = torch.from_numpy(np.array([0x7FC00001], dtype=np.uint32).view(np.float32))
    entry = one(tmp_path, quiet, other)
    assert entry.status == WITHIN_TOLERANCE and entry.values is not None
    assert not entry.values.nan_positions_differ


def test_inf_positions(tmp_path: Path) -> None:
    entry = one(tmp_path, torch.tensor([INF, 1.0]), torch.tensor([1.0, 1.0]))
    assert entry.values is not None and entry.values.inf_positions_differ
    assert entry.values.max_abs_diff == INF and entry.changes == ("Inf positions differ",)


def test_integers_are_exact_whatever_the_tolerance(tmp_path: Path) -> None:
    entry = one(tmp_path, torch.tensor([100000]), torch.tensor([100001]), rtol=0.1)
    assert entry.status == DIFFER and entry.values is not None
    assert entry.values.max_abs_diff == 1.0
    assert one(tmp_path, torch.tensor([True]), torch.tensor([False])).status == DIFFER


def test_bfloat16_against_float32(tmp_path: Path) -> None:
    exact = torch.tensor([1.5, -0.25, 3.0])
    entry = one(tmp_path, exact.bfloat16(), exact)
    assert entry.status == WITHIN_TOLERANCE and entry.values is not None
    assert entry.values.compared_as == "float32"
    rounded = one(tmp_path, torch.tensor([1.001]).bfloat16(), torch.tensor([1.001]))
    assert rounded.status == DIFFER


def test_views_and_strides_compare_by_value(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    entry = one(tmp_path, base.t(), base.t().contiguous())  # non-contiguous vs contiguous
    assert entry.status == IDENTICAL
    sliced = one(tmp_path, base[1:], base[1:].clone())  # storage offset vs none
    assert sliced.status == IDENTICAL


@pytest.mark.parametrize(
    ("a", "b", "common"),
    [
        ("float16", "float32", "float32"),
        ("bfloat16", "float16", "float32"),
        ("bfloat16", "float64", "float64"),
        ("bfloat16", "int64", "bfloat16"),
        ("int64", "float32", "float64"),
        ("int32", "int64", "int64"),
        ("float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e4m3fn", "float16", None),
    ],
)
def test_compare_dtype(a: str, b: str, common: str | None) -> None:
    assert compare_dtype(a, b) == common
    assert compare_dtype(b, a) == common


def test_undecodable_dtypes_compare_bits(tmp_path: Path) -> None:
    base = torch.tensor([0.5, 1.0, 2.0]).to(torch.float8_e4m3fn)
    changed = torch.tensor([0.5, 1.0, 4.0]).to(torch.float8_e4m3fn)
    entry = one(tmp_path, base, changed)
    assert entry.status == DIFFER and entry.values is not None
    assert entry.values.mismatched == 1 and entry.values.max_abs_diff is None
    assert one(tmp_path, base, base.clone()).status == IDENTICAL
    mixed = one(tmp_path, base, base.float())
    assert mixed.status == DIFFER and "no common dtype" in mixed.changes[-1]


@pytest.mark.parametrize("seed", range(6))
def test_mismatch_counts_agree_with_torch_isclose(tmp_path: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(500, generator=generator)
    b = a + torch.randn(500, generator=generator) * 1e-5 * (seed + 1)
    specials = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 1e-9])
    a[:6], b[:6] = specials, specials[torch.randperm(6, generator=generator)]
    rtol, atol = 1e-5 * seed, 1e-6
    entry = one(tmp_path, a, b, rtol=rtol, atol=atol)
    close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    assert entry.values is not None
    assert entry.values.mismatched == int((~close).sum())
    both = ~(a.isnan() | b.isnan())
    difference = torch.where(a[both] == b[both], 0.0, (a[both].double() - b[both].double()).abs())
    assert entry.values.max_abs_diff == difference.max().item()
    assert entry.values.nan_positions_differ == bool((a.isnan() != b.isnan()).any())


# --- rounded: is one side exactly the other rounded to its dtype? ----------------------------

#: values that take every path of a rounding: ties, subnormals, overflow, signed zeros, NaN, Inf
TRICKY = [1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-12, 3.0e-8, 6.0e-5, 7.0e4, 1.0e39, -0.0, 0.0,
          NAN, INF, -INF, 1 / 3, -2.75e-3]  # fmt: skip


@pytest.mark.parametrize(
    ("wide", "narrow"),
    [("float32", "float16"), ("float32", "bfloat16"), ("float64", "float32"),
     ("float64", "float16"), ("float64", "bfloat16")],
)  # fmt: skip
def test_rounded_is_equal_exactly_when_torch_would_round_to_the_other(
    tmp_path: Path, wide: str, narrow: str
) -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor(TRICKY, dtype=torch.float64), torch.randn(300, generator=generator, dtype=torch.float64)])  # fmt: skip
    a = values.to(getattr(torch, wide))
    b = a.to(getattr(torch, narrow))  # torch's own rounding
    for first, second in ((a, b), (b, a)):  # either side may be the narrower one
        entry = one(tmp_path, first, second, rounded=True)
        assert entry.status == EQUAL_AFTER_ROUNDING, entry
        assert entry.values is not None and entry.values.equal_after_rounding
        assert entry.values.compared_as == narrow and entry.values.mismatched == 0
        assert entry.changes[0].endswith(f", compared after rounding to {narrow}")
    assert one(tmp_path, a, b).status != EQUAL_AFTER_ROUNDING  # only when asked


def test_rounded_counts_the_elements_that_are_not_the_rounding(tmp_path: Path) -> None:
    wide = torch.linspace(-3, 3, 100)
    narrow = wide.half()
    narrow[7] = torch.nextafter(narrow[7], torch.tensor(10.0, dtype=torch.float16))  # one ulp
    entry = one(tmp_path, wide, narrow, rounded=True)
    assert entry.status == DIFFER and entry.values is not None
    assert (entry.values.mismatched, entry.values.compared_as) == (1, "float16")
    expected = (narrow[7].double() - wide[7].half().double()).abs().item()
    assert entry.values.max_abs_diff == expected  # measured in float16, after rounding
    loose = one(tmp_path, wide, narrow, rounded=True, rtol=1e-2)
    assert loose.status == WITHIN_TOLERANCE  # the tolerance still applies to what differs


@pytest.mark.parametrize(
    ("wide", "narrow", "status"),
    [
        ([-0.0], [0.0], WITHIN_TOLERANCE),  # equal values, but not what rounding -0.0 gives
        ([1.0], [NAN], DIFFER),
        ([NAN], [NAN], EQUAL_AFTER_ROUNDING),  # any NaN is the rounding of a NaN
        ([1e5], [INF], EQUAL_AFTER_ROUNDING),  # float16 overflows to inf, as torch rounds
        ([1e5], [65504.0], DIFFER),
    ],
)
def test_rounded_edge_values(tmp_path: Path, wide: list, narrow: list, status: str) -> None:
    narrow_bits = torch.tensor(narrow).half()
    if narrow == [NAN]:  # a NaN payload that torch's rounding of a float32 NaN does not give
        narrow_bits = torch.tensor([0x7E01], dtype=torch.int16).view(torch.float16)
    assert one(tmp_path, torch.tensor(wide), narrow_bits, rounded=True).status == status


def test_rounded_changes_nothing_for_same_dtypes_integers_and_unordered_floats(
    tmp_path: Path,
) -> None:
    same = one(tmp_path, torch.ones(3), torch.ones(3), rounded=True)
    assert same.status == IDENTICAL
    assert one(tmp_path, torch.tensor([1]), torch.tensor([1.0]), rounded=True).status == (
        WITHIN_TOLERANCE  # int64 with float32: compared as float64, as without rounded
    )
    # float16 and bfloat16 hold different values: neither is the other rounded
    exact = torch.tensor([1.5, -0.25])
    mixed = one(tmp_path, exact.half(), exact.bfloat16(), rounded=True)
    assert mixed.status == WITHIN_TOLERANCE and mixed.values is not None
    assert mixed.changes == (
        "dtype float16 -> bfloat16, compared as float32 (neither rounds to the other)",
    )


def test_ckpttool_fp16_weights_are_the_fp32_resume_model_rounded() -> None:
    """The pair MiniMind users compare most: ``save_checkpoint`` keeps the training dtype."""
    weights = FIXTURES / "ckpttool/pretrain_32.pth"
    resume = FIXTURES / "ckpttool/pretrain_32_resume.pth"
    report = diff(weights, resume, rounded=True)
    assert report.equal and report.counts() == counts(rounded=21)
    assert report.summary() == (
        "0 identical, 21 equal after rounding, 0 differ within tolerance, 0 differ, "
        "0 only in A, 0 only in B"
    )
    assert not any("--rounded" in note for note in report.notes)
    strict = diff(weights, resume)
    assert not strict.equal and strict.notes[-1] == (
        "the dtypes differ: 21 tensors are float16 in A and float32 in B, compared in the wider "
        "dtype. To check whether one side is exactly the other rounded to its dtype, use --rounded"
    )
    assert "equal after rounding" not in strict.summary()  # the line keeps its form


def test_the_dtype_note_counts_only_pairs_whose_values_were_compared(tmp_path: Path) -> None:
    path_a, path_b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save({"same": torch.ones(2), "cast": torch.ones(2), "reshaped": torch.ones(4)}, path_a)
    torch.save({"same": torch.ones(2), "cast": torch.ones(2).half(), "reshaped": torch.ones(2, 2).half()}, path_b)  # fmt: skip
    assert diff(path_a, path_b).notes == [
        "the dtypes differ: 1 tensor is float32 in A and float16 in B, compared in the wider "
        "dtype. To check whether one side is exactly the other rounded to its dtype, use --rounded"
    ]
    assert diff(path_a, path_b, quick=True).notes[-1].startswith("--quick")
    assert diff(path_a, path_a).notes == []


# --- streaming -------------------------------------------------------------------------------


def test_values_are_read_in_bounded_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read is at most CHUNK elements, whatever the tensor's size; a change in a later run
    is found and counted once."""
    monkeypatch.setattr(diff_values, "CHUNK", 100)
    a = torch.arange(1000, dtype=torch.float32)
    b = a.clone()
    b[777] = -1.0
    reads: list[int] = []
    original = Checkpoint.read_bytes

    def counting(self: Checkpoint, record: Any) -> Any:
        reads.append(record.nbytes)
        return original(self, record)

    monkeypatch.setattr(Checkpoint, "read_bytes", counting)
    entry = one(tmp_path, a, b)
    assert entry.status == DIFFER and entry.values is not None
    assert entry.values.mismatched == 1 and entry.values.max_abs_diff == 778.0
    # 20 runs, and A's 7 equal runs before the change once more, for ‖A‖ (rel change)
    assert len(reads) == 20 + 7 and max(reads) == 100 * 4


def test_progress_counts_every_byte_compared() -> None:
    seen: list[int] = []
    with open_checkpoint(BASE) as a, open_checkpoint(PAIRS / "base_fp16.pth") as b:
        plan = plan_diff(a, b)
        run_diff(a, b, plan, progress=seen.append)
    assert sum(seen) == plan.value_bytes == (728 + 128) * (4 + 2)  # the tied tensor twice


def test_errors_name_the_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("just some text\n")
    with pytest.raises(NotACheckpointError, match=f"^{re.escape(str(text))}: not a checkpoint"):
        diff(BASE, text)
    with pytest.raises(InputError, match=r"missing\.pth: no such file"):
        diff(tmp_path / "missing.pth", BASE)


def test_safetensors_metadata_is_compared_but_not_aliases_or_provenance(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    # save_model's alias entries against convert's: the same declaration, no difference
    assert diff(PAIRS / "base.safetensors", PAIRS / "base_aliases.safetensors").equal
    tensors = {"w": torch.ones(2)}
    save_file(
        tensors, tmp_path / "a.safetensors", metadata={"ckpttool.source": "a.pth", "note": "x"}
    )
    save_file(
        tensors, tmp_path / "b.safetensors", metadata={"ckpttool.source": "b.pth", "note": "y"}
    )
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert report.fields == [FieldDiff("__metadata__.note", "changed", "x", "y")]


def test_a_view_of_a_shared_storage_is_not_a_tie(tmp_path: Path) -> None:
    """Only the exact same view counts as a tie: a slice of a kept tensor is not its alias."""
    weight = torch.arange(6, dtype=torch.float32)
    with_views = tmp_path / "views.pth"
    torch.save({"weight": weight, "tail": weight[1:], "same": weight}, with_views)
    only_weight = tmp_path / "weight.pth"
    torch.save({"weight": weight.clone()}, only_weight)
    report = diff(with_views, only_weight)
    assert not_identical(report) == {"tail": ONLY_A}
    assert by_key(report)["same"].alias == Alias("b", "weight", "shared_storage")
