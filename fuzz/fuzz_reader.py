"""Long-running fuzzer for the reader, ``show`` and ``verify`` (see fuzz/README.md).

    python -m fuzz.fuzz_reader -max_total_time=660 fuzz/corpus      # atheris (libFuzzer)
    python -m fuzz.fuzz_reader --loop 660                           # without atheris

Each input is written to a file and given to :func:`tests.support.fuzz_targets.exercise`: open
it (strict and lenient), build and render ``show``'s report with ``--stats``, its JSON and tree,
``verify --values`` and ``scan``. Anything but a :class:`~ckpttool.errors.CkptError` escaping is a crash:
libFuzzer saves the input under ``fuzz/artifacts/`` (the loop mode does the same) and stops.

With atheris, ckpttool's modules are instrumented for coverage and a custom mutator mixes
libFuzzer's own byte mutations with the structure-aware ones of
:mod:`tests.support.fuzz_targets` (zip records swapped or duplicated, data.pkl mutated and
re-zipped with a valid CRC, the safetensors JSON header edited with its length fixed): raw bit
flips alone mostly stop at the zip's CRC or the header's length. Seeds are the fixtures listed
in ``fuzz_targets.SEEDS``; ``tests.support`` is the part of ``tests/`` meant for import here.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from tests.support.fuzz_targets import MUTATIONS, SEEDS, exercise, mutate

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
SCRATCH = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
INPUT = SCRATCH / "input.pth"
SEED_BYTES = [path.read_bytes() for path in SEEDS]
MAX_LEN = max(len(data) for data in SEED_BYTES) * 2


def run_one(data: bytes) -> None:
    INPUT.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # NumPy noise would reach users' stderr
        exercise(INPUT)


def structured_mutation(data: bytes, seed: int) -> bytes:
    """1-3 mutations of ``data`` (sometimes of a fresh seed file instead)."""
    rng = random.Random(seed)
    if not data or rng.random() < 0.1:
        data = rng.choice(SEED_BYTES)
    for _ in range(rng.randint(1, 3)):
        data = mutate(data, rng.choice(MUTATIONS), rng, SEED_BYTES)
    return data[:MAX_LEN]


def fuzz_with_atheris(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["ckpttool"]):
        pass

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        if seed % 4 == 0:  # a quarter of the time, libFuzzer's own byte-level mutators
            return bytes(atheris.Mutate(data, min(max_size, MAX_LEN)))
        return structured_mutation(data, seed)[:max_size]

    ARTIFACTS.mkdir(exist_ok=True)
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    for directory in corpus:  # seed an empty corpus folder with the fixtures
        os.makedirs(directory, exist_ok=True)
        if not os.listdir(directory):
            for number, path in enumerate(SEEDS):
                (Path(directory) / f"{number:02d}-{path.name}").write_bytes(path.read_bytes())
    flags = [f"-max_len={MAX_LEN}", "-timeout=20", "-rss_limit_mb=4096",
             f"-artifact_prefix={ARTIFACTS}/", "-print_final_stats=1"]  # fmt: skip
    atheris.Setup([argv[0], *flags, *argv[1:]], run_one, custom_mutator=custom_mutator)
    atheris.Fuzz()


def fuzz_loop(seconds: float) -> None:
    """No atheris: the structured mutations in a plain loop, each input under a SIGALRM guard."""
    import signal

    def hang(signum: int, frame: object) -> None:
        raise TimeoutError("one input ran over 20 s")

    signal.signal(signal.SIGALRM, hang)
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "0")))
    deadline = time.monotonic() + seconds
    executions = 0
    while time.monotonic() < deadline:
        data = structured_mutation(rng.choice(SEED_BYTES), rng.randrange(2**32))
        signal.alarm(20)
        try:
            run_one(data)
        except Exception:
            ARTIFACTS.mkdir(exist_ok=True)
            crash = ARTIFACTS / f"crash-loop-{executions}"
            crash.write_bytes(data)
            traceback.print_exc()
            print(f"crash after {executions:,} executions; input saved to {crash}")
            sys.exit(1)
        finally:
            signal.alarm(0)
        executions += 1
    print(f"stat::number_of_executed_units: {executions}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--loop":
        fuzz_loop(float(sys.argv[2]))
    else:
        fuzz_with_atheris(sys.argv)
