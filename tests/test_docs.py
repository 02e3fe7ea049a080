"""The docs against the code: docs/cli.md is current, every command and option is documented,
every relative link in README.md and docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from tools import cli_reference, module_map

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
COMMANDS = [(title, command) for title, command, _ in cli_reference.walk()][1:]


def test_cli_md_is_current() -> None:
    expected = cli_reference.render()
    actual = cli_reference.CLI_MD.read_text() if cli_reference.CLI_MD.is_file() else ""
    assert actual == expected, (
        f"docs/cli.md is out of date with the commands' --help: run `{cli_reference.REGENERATE}` "
        "from the repository root and commit docs/cli.md"
    )


def test_module_map_is_current() -> None:
    """docs/development.md's map is what tools/module_map.py writes from the docstrings, floor by
    floor in the order of the layers contract."""
    page = module_map.PAGE.read_text()
    assert module_map.rewritten(page) == page, (
        "docs/development.md's module map is out of date: run `python -m tools.module_map` "
        "from the repository root and commit docs/development.md"
    )


def test_module_map_follows_the_layers_contract() -> None:
    """Every top-level module and package of ckpttool is on a floor of the contract (or is the
    package's own ``__init__``/``__main__``), and the map lists them in the contract's order."""
    floors = module_map.floors()
    tops = {
        p.stem for p in module_map.PACKAGE.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name != "__pycache__"
    }  # fmt: skip
    assert tops - set(floors) == {"__init__", "__main__"}
    lines = module_map.module_map().splitlines()
    rows = [
        next(i for i, line in enumerate(lines) if line.startswith(f"  {floor}")) for floor in floors
    ]
    assert rows == sorted(rows)


def test_every_command_has_a_page_linked_from_readme_and_the_docs_index() -> None:
    names = {title.split(" ", 1)[1] for title, _ in COMMANDS}
    assert names == set(cli_reference.PAGES), (
        "each command needs a page under docs/ and an entry in tools/cli_reference.py PAGES"
    )
    readme = README.read_text()
    index = (DOCS / "README.md").read_text()
    for page in cli_reference.PAGES.values():
        assert (DOCS / page).is_file(), page
        assert f"](docs/{page})" in readme, f"README.md does not link docs/{page}"
        assert f"]({page})" in index, f"docs/README.md does not link {page}"


def option_strings(command: click.Command) -> list[str]:
    """Every spelling of every option (``-o``, ``--output``), ``--help`` aside."""
    return [
        spelling
        for param in command.params
        if isinstance(param, click.Option)
        for spelling in (*param.opts, *param.secondary_opts)
    ]


def mentions(text: str, option: str) -> bool:
    """``option`` as a whole word: ``--section`` is not found in ``--sections``."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def cli_md_section(title: str) -> str:
    text = cli_reference.CLI_MD.read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_walk_finds_every_command_and_option() -> None:
    """Guards the tests below against an empty walk."""
    assert [t for t, _ in COMMANDS] == [
        "ckpttool average", "ckpttool convert", "ckpttool diff", "ckpttool edit", "ckpttool lora",
        "ckpttool lora extract", "ckpttool lora merge", "ckpttool merge", "ckpttool repair",
        "ckpttool rescale-step",
        "ckpttool scan", "ckpttool show", "ckpttool trend", "ckpttool verify",
    ]  # fmt: skip
    assert {"-o", "--output", "--world-size"} <= set(option_strings(dict(COMMANDS)["ckpttool rescale-step"]))  # fmt: skip


@pytest.mark.parametrize(("title", "command"), COMMANDS, ids=[t for t, _ in COMMANDS])
def test_every_option_is_in_cli_md_and_on_the_command_page(
    title: str, command: click.Command
) -> None:
    page_name = cli_reference.PAGES[title.split(" ", 1)[1]]
    page = (DOCS / page_name).read_text()
    reference = cli_md_section(title)
    assert f"Usage: {title} " in reference
    options = option_strings(command)
    assert options or isinstance(command, click.Group)  # a group (lora) may have none
    assert [o for o in options if not mentions(reference, o)] == []
    missing = [o for o in options if not mentions(page, o)]
    assert missing == [], f"docs/{page_name} does not mention {missing}"


def test_the_group_options_are_in_cli_md() -> None:
    options = option_strings(cli_reference.cli)
    assert "--version" in options
    assert all(mentions(cli_md_section("ckpttool"), o) for o in options)


# --- links ------------------------------------------------------------------------------------

PAGES = sorted([README, ROOT / "bench" / "README.md", *DOCS.rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")


def prose(markdown: str) -> str:
    """The text outside code: fenced blocks and inline code spans removed."""
    without_blocks = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", without_blocks)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces to
    hyphens, repeats numbered)."""
    anchors: set[str] = set()
    without_blocks = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_blocks, flags=re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # https:, mailto:
    ]


def test_the_pages_have_links_to_check() -> None:
    assert README in PAGES and DOCS / "cli.md" in PAGES
    assert sum(len(relative_links(p)) for p in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_at_a_file_and_anchor_that_exist(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif (
            fragment
            and resolved.suffix == ".md"
            and fragment not in github_anchors(resolved.read_text())
        ):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_anchor_rule_matches_github() -> None:
    text = (
        "# `ckpttool show`: what a checkpoint holds\n## JSON (`--json`)\n## Limits\n### Limits\n"
        "## torch.distributed.checkpoint (DCP) directories\n## 4. Results\n"
    )
    assert github_anchors(text) == {
        "ckpttool-show-what-a-checkpoint-holds", "json---json", "limits", "limits-1",
        "torchdistributedcheckpoint-dcp-directories", "4-results",
    }  # fmt: skip
