"""Config loading: validation messages, overrides, the TOML round trip, and key stability."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import fake_stages
import pytest
from typer.testing import CliRunner

from cram.pipeline import config, runner
from cram.pipeline.commands import cli


@dataclass(frozen=True)
class Corpus:
    kind: Literal["text", "jsonl"] = "text"
    paths: tuple[str, ...] = ()
    limit: int | None = None


@dataclass(frozen=True)
class Task:
    name: str = "t"
    weight: float = 1.0


@dataclass(frozen=True)
class Stage:
    lr: float = 1e-3
    steps: int = 10
    compile: bool = True
    corpus: Corpus = Corpus()
    tasks: list[Task] = field(default_factory=list)
    betas: tuple[float, float] = (0.9, 0.98)
    extra: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: {self.steps} must be at least 1")


CLASSES = {"train": Stage}
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Retiring:
    RETIRED: ClassVar[dict[str, object]] = {"old": 1, "switch": False}
    value: int = 0


def load(text: str, overrides=(), tmp_path=None):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return config.load(path, CLASSES, list(overrides))


def error(text: str, tmp_path, overrides=()) -> str:
    with pytest.raises(config.ConfigError) as e:
        load(text, overrides, tmp_path)
    return str(e.value)


def test_a_full_file_maps_onto_typed_frozen_dataclasses(tmp_path):
    conf = load(
        """
        [run]
        name = "x"
        seed = 3
        [train]
        lr = 1
        betas = [0.8, 0.9]
        extra = {a = 1}
        [train.corpus]
        kind = "jsonl"
        paths = ["a", "b"]
        [[train.tasks]]
        name = "one"
        [[train.tasks]]
        name = "two"
        weight = 2
        """,
        tmp_path=tmp_path,
    )
    train = conf.stages["train"]
    assert conf.run.name == "x" and conf.run.seed == 3 and conf.run.device == "auto"
    assert train.lr == 1.0 and isinstance(train.lr, float)
    assert train.corpus == Corpus(kind="jsonl", paths=("a", "b"))
    assert train.tasks == [Task("one"), Task("two", 2.0)]
    assert train.betas == (0.8, 0.9) and train.extra == {"a": 1}


def test_the_run_section_takes_the_edges_of_each_range(tmp_path):
    conf = load("[run]\nseed = 9223372036854775807\ndevice = 'cuda:12'\nroot = '/tmp/runs'", tmp_path=tmp_path)
    assert conf.run.seed == 2**63 - 1 and conf.run.device == "cuda:12" and conf.run.root == "/tmp/runs"
    assert load("[run]\nseed = 0\ndevice = 'cpu'", tmp_path=tmp_path).run.seed == 0


def test_missing_sections_take_their_defaults(tmp_path):
    assert load("", tmp_path=tmp_path).stages["train"] == Stage()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[train]\nrl = 1e-3", "[train] unknown key 'rl'; did you mean 'lr'?"),
        ("[train.corpus]\npath = ['a']", "[train.corpus] unknown key 'path'; did you mean 'paths'?"),
        ("[trian]\nlr = 1", "unknown section [trian]; did you mean 'train'?"),
        ("[train]\nsteps = 'ten'", "train.steps: expected an integer, got 'ten'"),
        ("[train]\nsteps = 1.5", "train.steps: expected an integer, got 1.5"),
        ("[train]\ncompile = 1", "train.compile: expected true or false, got 1"),
        ("[train]\nlr = true", "train.lr: expected a number, got True"),
        ("[train.corpus]\nkind = 'csv'", "train.corpus.kind: 'csv' is not allowed; choose one of 'text', 'jsonl'"),
        ("[train]\nbetas = [0.9]", "train.betas: expected"),
        ("[train]\nsteps = 0", "[train] steps: 0 must be at least 1"),
        ("[[train.tasks]]\nweight = 'x'", "train.tasks[0].weight: expected a number, got 'x'"),
        ("[run]\ndevice = 'tpu'", "[run] device: 'tpu' is not one of auto, cpu, cuda, cuda:N"),
        ("[run]\ndevice = 'cuda:abc'", "[run] device: 'cuda:abc' is not one of auto, cpu, cuda, cuda:N"),
        ("[run]\ndevice = 'cuda:'", "[run] device: 'cuda:' is not one of"),
        ("[run]\nseed = -1", "[run] seed: -1 must be in [0, 2**63 - 1]"),
        ("[run]\nseed = 9223372036854775808", "[run] seed: 9223372036854775808 must be in [0, 2**63 - 1]"),
        ("[run]\nroot = ''", "[run] root: '' must name a folder"),
        ("[run]\nroot = '  '", "[run] root: '  ' must name a folder"),
        ("[train\nlr = 1", "not valid TOML"),
    ],
)
def test_bad_files_name_the_file_the_key_and_what_is_allowed(tmp_path, text, expected):
    message = error(text, tmp_path)
    assert expected in message
    assert str(tmp_path / "p.toml") in message


@pytest.mark.parametrize(
    "overrides, lr, limit",
    [
        (["train.lr=5e-4"], 5e-4, None),  # the file's lr replaced, the default limit kept
        (["train.corpus.limit=7"], 1e-3, 7),  # a nested key set, the file's lr kept
        (["train.lr=5e-4", "train.corpus.limit=7"], 5e-4, 7),  # each of two applied
        (["train.lr=5e-4", "train.lr=2e-4"], 2e-4, None),  # the last of two for one key wins
    ],
)
def test_overrides_replace_their_keys_and_keep_the_rest(tmp_path, overrides, lr, limit):
    conf = load("[train]\nlr = 1e-3\nsteps = 3", overrides, tmp_path)
    train = conf.stages["train"]
    assert (train.lr, train.corpus.limit, train.steps) == (lr, limit, 3)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1", "--set: [train] unknown key 'lrr'; did you mean 'lr'?"),
        ("train.steps=many", "--set: train.steps: expected an integer, got 'many'"),
        ("trane.lr=1", "unknown section [trane]; did you mean 'train'?"),
        ("train.lr", "expected section.key=value"),
        ("train.lr.x=1", "'lr' is a value, not a table"),
    ],
)
def test_overrides_are_validated_like_the_file(tmp_path, override, expected):
    assert expected in error("[train]\nlr = 1e-3", tmp_path, [override])


def test_missing_file(tmp_path):
    with pytest.raises(config.ConfigError, match="no such config file"):
        config.load(tmp_path / "nope.toml", CLASSES)


def test_resolved_config_round_trips_through_toml(tmp_path):
    conf = load(
        "[train]\nlr = 2e-4\nbetas = [0.5, 0.25]\nextra = {k = 3}\n[train.corpus]\npaths = ['a b', 'c\"d']\n"
        "[[train.tasks]]\nname = 'n'\nweight = 0.5\n",
        tmp_path=tmp_path,
    )
    text = config.to_toml(conf.to_dict())
    again = config.parse(text, CLASSES)
    assert again == conf


def test_keys_depend_on_meaning_not_on_spelling(tmp_path):
    a = load("[train]\nlr = 0.001\nsteps = 10", tmp_path=tmp_path)
    b = load("[train]\nsteps = 10  # same values, another order and spelling\nlr = 1e-3", tmp_path=tmp_path)
    c = load("[train]\nlr = 0.002", tmp_path=tmp_path)
    assert config.digest(a.stages["train"]) == config.digest(b.stages["train"])
    assert config.digest(a.stages["train"]) != config.digest(c.stages["train"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "beta.valeu=3"], "[beta] unknown key 'valeu'; did you mean 'value'?"),
        (["--set", "beta.value=x"], "beta.value: expected an integer, got 'x'"),
        (["--set", "run.device='gpu'"], "device: 'gpu' is not one of"),
        (["--bogus"], "No such option"),
    ],
)
def test_cli_config_errors_exit_2_with_the_key(tmp_path, monkeypatch, args, expected):
    monkeypatch.setattr(runner, "default_stages", fake_stages.modules)
    path = tmp_path / "p.toml"
    path.write_text(fake_stages.PIPELINE.format(root=tmp_path / "runs"))
    result = CliRunner().invoke(cli.app, ["run", str(path), *args], env={"COLUMNS": "250"})
    assert result.exit_code == 2
    assert expected in result.output
    assert not (tmp_path / "runs").exists()


def test_cli_unknown_key_in_file_exits_2(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "default_stages", fake_stages.modules)
    path = tmp_path / "p.toml"
    path.write_text("[gamma]\nvalue = 1\nfial = 'crash'\n")
    result = CliRunner().invoke(cli.app, ["run", str(path)], env={"COLUMNS": "250"})
    assert result.exit_code == 2
    assert f"{path}: [gamma] unknown key 'fial'; did you mean 'fail'?" in result.output


def test_a_retired_key_reads_at_its_retired_value_and_is_refused_at_any_other(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[train]\nvalue = 2\nold = 1\nswitch = false\n")
    assert config.load(path, {"train": Retiring}).stages["train"] == Retiring(value=2)
    for given, shown, only in (
        ("old = 3", "old = 3", "old = 1"),
        ("old = true", "old = true", "old = 1"),  # equal to 1 in Python, not in TOML
        ("old = 1.0", "old = 1.0", "old = 1"),
        ("switch = 'on'", 'switch = "on"', "switch = false"),
    ):
        path.write_text(f"[train]\n{given}\n")
        with pytest.raises(config.ConfigError) as e:
            config.load(path, {"train": Retiring})
        assert str(e.value) == (
            f"{path}: [train] {shown}: a setting this version no longer has; only {only} (what every run now "
            "does) is read, or leave it out"
        )
    path.write_text("[train]\n")
    with pytest.raises(config.ConfigError, match=r"^--set: \[train\] old = 2: a setting this version no longer"):
        config.load(path, {"train": Retiring}, ["train.old=2"])


def run_folder_saved_with(tmp_path: Path, **pretrain_keys: object) -> Path:
    """A run folder whose config.toml is the default pipeline's as a version with `pretrain_keys` saved it."""
    classes = runner.config_classes(runner.default_stages())
    saved = config.load(REPO / "pipeline.toml", classes).to_dict()
    for dotted, value in pretrain_keys.items():
        *tables, key = dotted.split("__")
        table = saved["pretrain"]
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = value
    run_dir = tmp_path / "runs" / "default"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config.to_toml(saved))
    return run_dir


def test_a_run_folder_saved_while_the_retired_settings_existed_resumes_as_the_same_run(tmp_path):
    run_dir = run_folder_saved_with(
        tmp_path, average_last=1, init_switch_params=False, model__value_residual=False, model__activation="gelu"
    )
    modules = runner.default_stages()
    today = config.load(REPO / "pipeline.toml", runner.config_classes(modules))
    assert runner.load_saved(run_dir, modules) == today  # the same configs, so the same keys


@pytest.mark.parametrize(
    "saved, message",
    [
        (
            dict(average_last=3),
            "[pretrain] average_last = 3: a setting this version no longer has; only average_last = 1",
        ),
        (dict(model__value_residual=True), "[pretrain.model] value_residual = true: a setting this version no longer"),
        (dict(model__activation="silu"), '[pretrain.model] activation = "silu": a setting this version no longer'),
    ],
)
def test_resuming_a_run_saved_with_a_retired_setting_on_exits_2_naming_it_and_changes_nothing(tmp_path, saved, message):
    run_dir = run_folder_saved_with(tmp_path, **saved)
    before = (run_dir / "config.toml").read_text()
    result = CliRunner().invoke(cli.app, ["resume", str(run_dir)], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert f"{run_dir / 'config.toml'}: {message}" in " ".join(result.output.split())
    assert [p.name for p in run_dir.iterdir()] == ["config.toml"] and (run_dir / "config.toml").read_text() == before
