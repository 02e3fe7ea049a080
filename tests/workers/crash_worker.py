"""SIGKILL a real write over an existing checkpoint, over and over, and report what is left.

``python -m tests.workers.crash_worker OPERATION KILLS WORK_DIR [SEED]`` prints one JSON object:
``{"operation", "seconds_uninterrupted", "trials": [...]}``. OPERATION is ``save``
(``save_checkpoint``: a weights file and a resume file), ``async_save`` (the same with
``async_save=True``, the weights changed while it writes, then ``wait_for_save``), ``convert`` (``ckpttool convert SRC
TARGET --force``), ``rescale`` (``ckpttool rescale-step TARGET --world-size 2``, in place) or
``repair`` (``ckpttool repair CUT -o TARGET --force`` of a resume file cut short; the cut file
itself must come out untouched: ``"untouched"`` in the report).

The worker imports torch once, builds the inputs, writes the *old* target(s), and produces the
*new* ones with one uninterrupted run (the outputs are deterministic, so every complete write
is byte-identical to it). Then, per trial: restore the old target, fork a child that runs the
operation, SIGKILL it after a random delay within the measured length of an uninterrupted run,
and record what each target now is (``old``, ``new`` or ``partial``: matching neither), whether
the reader and ``torch.load(weights_only=True)`` open it, the temp files left beside it, and
the leftovers ``verify`` reports. Trials continue until KILLS children were actually killed
(a child may finish before its kill; that trial is recorded but not counted, and the delays
after it are drawn from a shorter window, since run times vary on a loaded machine).

One thread for torch, set before any tensor op: forking a process whose OpenMP pool is running
can deadlock the child.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

#: Two 1024x1024 layers: a ~25 MB resume file (fp32 weights + AdamW state), 4 MB of weights.
WIDTH = 1024


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


class Operation:
    """Targets, how to write their new version (in a child), and their old bytes."""

    targets: list[Path]
    old: dict[Path, bytes]
    untouched: tuple[Path, ...] = ()  # inputs that must keep their bytes through every kill

    def run(self) -> None:  # in the forked child
        raise NotImplementedError

    def restore(self) -> None:
        for target in self.targets:
            target.write_bytes(self.old[target])


class Save(Operation):
    def __init__(self, work: Path) -> None:
        from ckpttool import save_checkpoint

        self.save = save_checkpoint
        self.model, self.optimizer = _model_and_optimizer()
        self.work = work
        weights, resume = self._save(epoch=0, step=10)  # the old pair
        self.targets = [weights, resume]
        self.old = {path: path.read_bytes() for path in self.targets}

    def _save(self, epoch: int, step: int) -> tuple[Path, Path]:
        return self.save(self.model, self.optimizer, save_dir=self.work, weight="pretrain",
                         hidden_size=WIDTH, epoch=epoch, step=step)  # fmt: skip

    def run(self) -> None:
        random.seed(0)  # Python reseeds the global RNG in a forked child; the file records it
        with torch.no_grad():  # the next "training step": new weights
            for parameter in self.model.parameters():
                parameter.mul_(0.5)
        self._save(epoch=1, step=20)


class AsyncSave(Save):
    """``save_checkpoint(..., async_save=True)``: the files written on a background thread
    while the "training" goes on changing the weights; killed anywhere, including after the
    call returned and before ``wait_for_save``."""

    def run(self) -> None:
        from ckpttool import train

        random.seed(0)
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.mul_(0.5)
        self.save(self.model, self.optimizer, save_dir=self.work, weight="pretrain",
                  hidden_size=WIDTH, epoch=1, step=20, async_save=True)  # fmt: skip
        with torch.no_grad():  # the next step, while the files are written
            for parameter in self.model.parameters():
                parameter.add_(1.0)
        train.wait_for_save()


class Convert(Operation):
    def __init__(self, work: Path) -> None:
        from ckpttool.commands.convert.run import convert

        model, _ = _model_and_optimizer()
        self.source = work / "weights.pth"
        torch.save(model.state_dict(), self.source)
        target = work / "weights.safetensors"
        convert(self.source, target, dtype="fp16")  # the old file: the same weights in fp16
        self.targets = [target]
        self.old = {target: target.read_bytes()}

    def run(self) -> None:
        from ckpttool.cli import cli

        cli.main(["convert", str(self.source), str(self.targets[0]), "--force"], "ckpttool")


class Rescale(Operation):
    def __init__(self, work: Path) -> None:
        save = Save(work)
        resume = save.targets[1]
        self.targets = [resume]
        self.old = {resume: resume.read_bytes()}

    def run(self) -> None:
        from ckpttool.cli import cli

        cli.main(["rescale-step", str(self.targets[0]), "--world-size", "2"], "ckpttool")


class Repair(Operation):
    def __init__(self, work: Path) -> None:
        from ckpttool.commands.repair import repair

        model, optimizer = _model_and_optimizer()
        whole = work / "resume.pth"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": 1, "step": 20}, whole)  # fmt: skip
        data = whole.read_bytes()
        self.source = work / "cut.pth"
        self.source.write_bytes(data[: len(data) * 6 // 10])
        older = work / "older_cut.pth"  # the old target: what a repair of a longer cut wrote
        older.write_bytes(data[: len(data) * 8 // 10])
        target = work / "repaired.pth"
        repair(older, target)
        self.targets = [target]
        self.old = {target: target.read_bytes()}
        self.untouched = (self.source,)

    def run(self) -> None:
        from ckpttool.cli import cli

        try:
            cli.main(
                ["repair", str(self.source), "-o", str(self.targets[0]), "--force"], "ckpttool"
            )
        except SystemExit as exit_:
            if exit_.code != 1:  # 1: tensors are lost, as they are from this cut
                raise
            raise SystemExit(0) from None


OPERATIONS: dict[str, Callable[[Path], Operation]] = {
    "save": Save,
    "async_save": AsyncSave,
    "convert": Convert,
    "rescale": Rescale,
    "repair": Repair,
}


def _fork_run(operation: Operation) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child exits
            operation.run()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            os._exit(code)
    return pid


def _temps(target: Path) -> list[str]:
    from ckpttool.io.atomic import temp_name_pattern

    return sorted(str(p) for p in target.parent.glob(temp_name_pattern(target)))


def _loadable(target: Path) -> tuple[bool, bool | None]:
    """(ckpttool's reader opens it, torch.load(weights_only=True) does; None for non-.pth)."""
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.errors import CkptError

    try:
        open_checkpoint(target).close()
        reader = True
    except CkptError:
        reader = False
    if target.suffix != ".pth":
        return reader, None
    try:
        torch.load(target, weights_only=True, map_location="cpu")
        return reader, True
    except Exception:
        return reader, False


def main(argv: list[str]) -> None:
    from ckpttool.commands.verify import verify_file
    from ckpttool.errors import CkptError

    name, kills, work = argv[0], int(argv[1]), Path(argv[2])
    rng = random.Random(int(argv[3]) if len(argv) > 3 else 0)  # not the global RNG: saved
    work.mkdir(parents=True, exist_ok=True)
    operation = OPERATIONS[name](work)
    inputs = {path: _digest(path) for path in operation.untouched}
    durations = []
    for _ in range(3):  # uninterrupted runs: the new bytes, and how long a write takes
        operation.restore()
        start = time.monotonic()
        _, status = os.waitpid(_fork_run(operation), 0)
        durations.append(time.monotonic() - start)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name}: an uninterrupted run failed")
    new = {target: _digest(target) for target in operation.targets}
    old = {target: hashlib.sha256(data).hexdigest() for target, data in operation.old.items()}
    if any(new[t] == old[t] for t in operation.targets) or any(_temps(t) for t in new):
        raise SystemExit(f"{name}: the new files equal the old ones, or temps were left")
    window = statistics.median(durations)
    trials: list[dict[str, Any]] = []
    killed = 0
    while killed < kills and len(trials) < kills * 10:
        operation.restore()
        delay = rng.uniform(0, window * 1.1)
        pid = _fork_run(operation)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        was_killed = os.WIFSIGNALED(status)
        killed += was_killed
        if not was_killed:  # the write finished first: on a loaded machine the measured
            window *= 0.8  # window can be longer than runs take now; aim earlier
        trial: dict[str, Any] = {"delay": round(delay, 4), "killed": was_killed, "targets": {}}
        for target in operation.targets:
            digest = _digest(target)
            state = (
                "old" if digest == old[target] else "new" if digest == new[target] else "partial"
            )
            reader, torch_load = _loadable(target)
            temps = _temps(target)
            try:
                leftovers: list[str] | None = verify_file(target).leftovers
            except CkptError:  # cannot even check it (an empty file): no report at all
                leftovers = None
            trial["targets"][target.name] = {
                "state": state,
                "reader": reader,
                "torch_load": torch_load,
                "temps": temps,
                "verify_leftovers": leftovers,
            }
            for temp in temps:
                os.unlink(temp)
        trials.append(trial)
    untouched = all(_digest(path) == digest for path, digest in inputs.items())
    json.dump({"operation": name, "seconds_uninterrupted": round(window, 3), "trials": trials,
               "untouched": untouched}, sys.stdout)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
