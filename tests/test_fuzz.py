"""Mutated fixtures through the reader, show and verify: only ckpttool's errors escape.

A bounded, reproducible run (hypothesis, derandomized) in the normal suite; ``fuzz/`` holds
the long-running fuzzer that shares these mutations and this property
(:mod:`tests.support.fuzz_targets`). Each example starts from a real fixture and applies one to
four mutations (truncation, bit flips, inserted/deleted bytes, boundary integers over length
fields, swapped or duplicated zip records, bytes spliced from another fixture); a SIGALRM timer
fails any example that runs longer than ``EXAMPLE_SECONDS`` (a hang).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzz_targets import MUTATIONS, SEEDS, exercise, mutate
from tests.support.timeouts import scaled

EXAMPLE_SECONDS = max(1, round(scaled(10)))  # SIGALRM takes whole seconds
SEED_BYTES = [path.read_bytes() for path in SEEDS]


class Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Hang(f"one example ran over {EXAMPLE_SECONDS} s")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    previous = signal.signal(signal.SIGALRM, _alarm)
    yield tmp_path_factory.mktemp("fuzz") / "input.pth"
    signal.signal(signal.SIGALRM, previous)


mutations = st.lists(
    st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2**32)), min_size=1, max_size=4
)


@pytest.mark.slow
@pytest.mark.filterwarnings("error::RuntimeWarning")  # NumPy noise would reach users' stderr
@settings(
    max_examples=2000,
    deadline=None,  # time is guarded by SIGALRM instead: hypothesis' deadline flakes on CI
    derandomize=True,  # the same examples on every run: reproducible in CI
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
@given(seed=st.integers(0, len(SEEDS) - 1), steps=mutations)
def test_mutated_fixtures_raise_only_ckpt_errors(
    scratch: Path, seed: int, steps: list[tuple[str, int]]
) -> None:
    data = SEED_BYTES[seed]
    for kind, salt in steps:
        data = mutate(data, kind, random.Random(salt), SEED_BYTES)
    scratch.write_bytes(data)
    signal.alarm(EXAMPLE_SECONDS)
    try:
        exercise(scratch)
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("kind", MUTATIONS)
def test_every_mutation_changes_the_bytes(kind: str) -> None:
    """The mutators are live: each one, over a few seeds, alters the fixture it is given."""
    resume = SEED_BYTES[0]
    assert any(mutate(resume, kind, random.Random(salt), SEED_BYTES) != resume for salt in range(8))
