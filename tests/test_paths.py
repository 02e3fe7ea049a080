"""Issue 49: paths and the errors about them. ``convert SRC DIR/`` writes into a directory; a
backup an interrupted run left never refuses the next ``--backup``; a missing file is a
``FileNotFoundError`` to a library caller; a symlink loop is one line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.errors import InputError, OutputExistsError
from tests.support.helpers import FIXTURES

WEIGHTS = FIXTURES / "minimind/pretrain_32.pth"
RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"


@pytest.mark.parametrize("to", ["safetensors", "pth"])
def test_convert_into_a_new_directory_named_with_a_slash(tmp_path: Path, to: str) -> None:
    """``convert X newdir/`` wrote a file named ``newdir``."""
    result = CliRunner().invoke(cli, ["convert", str(WEIGHTS), f"{tmp_path}/new/", "--to", to])
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "new").is_dir()
    assert [p.name for p in (tmp_path / "new").iterdir()] == [f"pretrain_32.{to}"]


@pytest.mark.parametrize("dst", ["a/b/", "shards"])
def test_a_convert_stopped_while_writing_removes_the_directory_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dst: str
) -> None:
    """Ctrl-C during ``convert SRC shards/`` left an empty ``shards/``."""
    from ckpttool.commands.convert import run

    def stopped(*args: object, **kwargs: object) -> None:
        assert (tmp_path / dst.split("/")[0]).is_dir()  # made before the write
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "write_outputs", stopped)
    shards = "100KB" if dst == "shards" else None
    with pytest.raises(KeyboardInterrupt):
        run.convert(WEIGHTS, f"{tmp_path}/{dst}", max_shard_size=shards)
    assert list(tmp_path.iterdir()) == []


def _bak(path: Path) -> Path:
    return path.with_name(path.name + ".bak")


@pytest.mark.parametrize("command", ["edit", "rescale-step"])
def test_a_backup_an_interrupted_run_left_does_not_refuse_the_next(
    tmp_path: Path, command: str
) -> None:
    """A SIGKILL between the backup's hard link and the rename leaves ``SRC.bak``, the
    original's own inode: the next ``--backup`` refused forever ("move it away first")."""
    path = tmp_path / "resume.pth"
    shutil.copyfile(RESUME, path)
    original = path.read_bytes()
    os.link(path, _bak(path))  # what the killed run left
    argv = {
        "edit": ["edit", str(path), "--drop", "optimizer", "--in-place", "--backup"],
        "rescale-step": ["rescale-step", str(path), "--world-size", "2", "--backup"],
    }[command]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.stderr
    assert _bak(path).read_bytes() == original and path.read_bytes() != original
    assert not os.path.samefile(path, _bak(path))


@pytest.mark.parametrize("command", ["edit", "rescale-step"])
def test_a_backup_of_other_bytes_is_never_overwritten(tmp_path: Path, command: str) -> None:
    from ckpttool.commands.edit import edit_file
    from ckpttool.commands.rescale.run import rescale_step

    path = tmp_path / "resume.pth"
    shutil.copyfile(RESUME, path)
    _bak(path).write_bytes(b"an older backup")
    with pytest.raises(OutputExistsError, match="already exists"):
        if command == "edit":
            edit_file(path, drop=["optimizer"], in_place=True, backup=True)
        else:
            rescale_step(path, 2, backup=True)
    assert _bak(path).read_bytes() == b"an older backup"
    assert path.read_bytes() == RESUME.read_bytes()


def test_a_stale_backup_stays_in_a_dry_run(tmp_path: Path) -> None:
    from ckpttool.commands.rescale.run import rescale_step

    path = tmp_path / "resume.pth"
    shutil.copyfile(RESUME, path)
    os.link(path, _bak(path))
    rescale_step(path, 2, backup=True, dry_run=True)
    assert os.path.samefile(path, _bak(path))


def test_a_missing_file_is_a_file_not_found_error(tmp_path: Path) -> None:
    import ckpttool

    with pytest.raises(FileNotFoundError, match="no such file"):
        ckpttool.load_state_dict(tmp_path / "nope.pth")
    with pytest.raises(FileNotFoundError):
        ckpttool.open_checkpoint(str(tmp_path / "nope.pth"))
    with pytest.raises(InputError):  # and still ckpttool's own error, exit code 2
        ckpttool.load_state_dict(tmp_path / "nope.pth")


def test_an_unreadable_file_is_a_permission_error(tmp_path: Path) -> None:
    """As a user who may not read it (root may: the check runs as ``nobody``)."""
    import ckpttool
    from tests.test_cli_fuzz import _as_nobody

    path = tmp_path / "locked.pth"
    shutil.copyfile(WEIGHTS, path)
    ckpttool.load_state_dict(path)  # every import done, before the drop
    path.chmod(0)

    def attempt() -> str:
        try:
            ckpttool.load_state_dict(path)
        except PermissionError as error:
            return f"PermissionError {isinstance(error, InputError)}"
        except Exception as error:  # reported: the test names what it got
            return type(error).__name__
        return "read"

    assert _as_nobody(attempt) == "PermissionError True"


def test_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a.pth").symlink_to("b.pth")
    (tmp_path / "b.pth").symlink_to("a.pth")
    for argv in (["rescale-step", "a.pth", "--world-size", "2"],
                 ["merge", "a.pth", "a.pth", "--method", "linear", "-o", "o.pth"]):  # fmt: skip
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            result = CliRunner().invoke(cli, argv)
        finally:
            os.chdir(cwd)
        assert (result.exit_code == 2 and result.exception is None) or isinstance(
            result.exception, SystemExit
        ), result.exception
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1


HF_SHARDED = FIXTURES / "frameworks" / "hf_sharded"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["edit", str(WEIGHTS), "--drop", "model.norm*", "-o", "{out}"], "pass --force"),
        (["edit", str(HF_SHARDED), "--drop", "model.norm*", "-o", "{dir}"], "pass --force"),
        (["repair", str(HF_SHARDED), "--fill-from", str(WEIGHTS)], "-o and --fill-from apply"),
        (["edit", str(HF_SHARDED), "--drop", "x", "--in-place", "--backup"], "--backup applies"),
        (["merge", str(WEIGHTS), str(WEIGHTS), "--method", "slerp", "-o", "{dir}/m.pth"], "--t"),
    ],
)
def test_errors_speak_the_command_line_at_the_command_line(
    tmp_path: Path, argv: list[str], flag: str
) -> None:
    """The library's messages said ``pass overwrite=True``, ``fill_from``, ``got None`` to a
    CLI user."""
    (tmp_path / "out.pth").write_bytes(b"kept")
    (tmp_path / "dir").mkdir()
    argv = [a.format(out=tmp_path / "out.pth", dir=tmp_path / "dir") for a in argv]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.stderr
    assert flag in result.stderr, result.stderr
    for python in ("overwrite=True", "fill_from", "in_place", "got None"):
        assert python not in result.stderr
    assert (tmp_path / "out.pth").read_bytes() == b"kept"


def test_every_library_phrase_the_cli_rewords_is_still_in_the_library() -> None:
    from ckpttool.cli.app import CLI_WORDS

    package = Path(__file__).resolve().parent.parent / "ckpttool"
    text = "".join(p.read_text() for p in package.rglob("*.py") if p.name != "app.py")
    for python, _ in CLI_WORDS:
        assert python.lstrip("(") in text, python


IN_PLACE = {  # every command that rewrites its input in place: (fixture, its arguments)
    "edit file": (RESUME, ["edit", "{link}", "--drop", "optimizer", "--in-place", "--backup"]),
    "edit model directory": (HF_SHARDED, ["edit", "{link}", "--drop", "model.norm*", "--in-place"]),
    "edit dcp directory": (
        FIXTURES / "dcp" / "checkpoint",
        ["edit", "{link}", "--for-inference", "--in-place"],
    ),
    "rescale-step file": (RESUME, ["rescale-step", "{link}", "--world-size", "2", "--backup"]),
    "rescale-step directory": (
        FIXTURES / "frameworks" / "accelerate_2proc" / "state",
        ["rescale-step", "{link}", "--world-size", "1", "--in-place"],
    ),
}


def _digests(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("case", sorted(IN_PLACE))
def test_an_in_place_rewrite_through_a_symlink_keeps_the_link(tmp_path: Path, case: str) -> None:
    """One rule (io/atomic.written_through): the file or directory the link names is replaced,
    the link stays. ``edit --in-place`` replaced the link with a file, rescale-step wrote
    through it."""
    fixture, argv = IN_PLACE[case]
    real = tmp_path / "real" / fixture.name
    real.parent.mkdir()
    if fixture.is_dir():
        shutil.copytree(fixture, real)
    else:
        shutil.copyfile(fixture, real)
    before = _digests(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    result = CliRunner().invoke(cli, [a.format(link=link) for a in argv])
    assert result.exit_code == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert _digests(real) != before  # the edit went to the file the link names
    backup = link.with_name("link.bak")
    if "--backup" in argv:
        assert not backup.is_symlink() and _digests(backup) == before
    leftovers = {p.name for p in tmp_path.iterdir()} - {"real", "link", "link.bak"}
    assert not leftovers and sorted(os.listdir(real.parent)) == [fixture.name]
