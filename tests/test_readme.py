"""Every `cram` command line the README and docs/ show works: `run` lines as `--dry-run` (they would train)
in an empty root, the others parse (`--help` after the line: an unknown command or option is still an error)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from cram.pipeline.commands import cli

REPO = Path(__file__).resolve().parents[1]


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_commands(page: Path = REPO / "README.md") -> list[str]:
    text = page.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        commands += [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("cram ")]
    commands += re.findall(r"`(cram [^`]+)`", text)
    # torchrun runs the same CLI: `torchrun ... -m cram.pipeline.commands.cli ARGS` is `cram ARGS`.
    torchrun = r"`torchrun [^`]*-m cram\.pipeline\.commands\.cli ([^`]+)`"
    commands += [f"cram {args}" for args in re.findall(torchrun, text)]
    return commands


def test_the_readme_shows_cram_commands():
    commands = readme_commands()
    assert len(commands) >= 10 and any("--set" in c for c in commands)


def test_the_docs_show_cram_commands_of_their_own():
    shown = {page.name: readme_commands(page) for page in DOCS}
    assert all(shown[name] for name in ("running.md", "serving.md", "continuing.md", "recipe.md")), shown


def test_every_readme_command_line_works(tmp_path, monkeypatch, plain_machine):
    monkeypatch.chdir(REPO)
    for page, command in [(page, c) for page in DOCS for c in readme_commands(page)]:
        args = shlex.split(command)[1:]
        if args[0] == "run" and len(args) > 1 and args[1].endswith(".toml"):  # a mention of `cram run` parses
            args += ["--dry-run", "--set", f"run.root={json.dumps(str(tmp_path))}"]
        elif "--help" not in args:
            args += ["--help"]
        result = CliRunner().invoke(cli.app, args, env={"COLUMNS": "250"})
        # `--only pack` in an empty run dir: refused for the run dir's state, not for the command line.
        upstream_missing = result.exit_code == 2 and "which is not done; run it first" in result.output
        assert result.exit_code == 0 or upstream_missing, f"{page.name}: {command}\n{result.output}"
    assert not any(tmp_path.iterdir())  # dry runs create nothing


def test_the_readmes_layout_names_every_stage_module():
    """The Layout section names each stage of `stages.ORDER` (a stage added there must be named) and counts none."""
    from cram.stages import ORDER

    layout = (REPO / "README.md").read_text(encoding="utf-8").split("## Layout", 1)[1].split("\n## ", 1)[0]
    assert [name for name in ORDER if f"`{name}`" not in layout] == []
    assert not re.search(r"\b(one|two|three|four|five|six|seven|\d+) stage modules", layout)
