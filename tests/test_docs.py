"""The README is a first page (short, the two commands, then what the default run does on the first screen),
and every relative link of the README, docs/ and bench/ leads to a file, and to a heading of it
where the link names one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench").glob("*.md"))]
FIRST_SCREEN = 60  # lines a newcomer sees before scrolling
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def test_the_readme_is_a_first_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    setup = [i for i, line in enumerate(lines) if line.startswith("python3 -m venv .venv && ")]
    assert len(setup) == 2 and setup[1] == setup[0] + 1 and lines[setup[0] - 1] == "```bash", setup
    assert setup[1] < FIRST_SCREEN // 2
    screen = "\n".join(lines[setup[1] + 1 : FIRST_SCREEN])
    # What the default run costs, reaches and leaves behind, right after the commands that start it.
    assert re.search(r"\d+ minutes", screen), "no run time"
    assert re.search(r"held-out MLM loss\W+\d\.\d+", screen), "no held-out loss"
    assert re.search(r"topic accuracy\W+0\.\d+", screen), "no topic score"
    assert "runs/default/" in screen, "no output folder"


def test_ci_runs_the_readmes_second_command_verbatim():
    second = next(line for line in README.read_text(encoding="utf-8").splitlines() if "'.[test]'" in line)
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").rstrip("\n").splitlines()
    assert ci[-1] == second


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(page: Path) -> list[str]:
    prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_link_reader_finds_links_outside_code():
    assert slug("Past 128 tokens: phases, [MASK]") == "past-128-tokens-phases-mask"
    assert len(links(README)) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        found = (page.parent / path).resolve()
        if not found.exists():
            broken.append(f"{target}: no such file")
        elif anchor and found.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", found.read_text(encoding="utf-8"), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(f"{target}: no heading '{anchor}'")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"
