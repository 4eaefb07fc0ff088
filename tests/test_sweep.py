"""`cram sweep` on the fake stages: grid parsing and validation, names, sharing, skip and resume."""

from __future__ import annotations

import fake_stages
import pytest
import test_runner

from cram.pipeline import config as cfg
from cram.pipeline.commands import sweep

pipe = test_runner.pipe  # the fixture: cram on the fake stages in a temporary folder
CLASSES = {"alpha": fake_stages.Config, "beta": fake_stages.Config, "gamma": fake_stages.Config}
GRID = ("--grid", "beta.value=10,20", "--grid", "gamma.value=100,200")
NAMES = [
    "t-beta.value_10-gamma.value_100",
    "t-beta.value_10-gamma.value_200",
    "t-beta.value_20-gamma.value_100",
    "t-beta.value_20-gamma.value_200",
]


def _all_calls(root) -> list[str]:
    return sorted(c for log in root.glob("*/calls.log") for c in log.read_text().split())


def test_every_combination_runs_once_sharing_upstream_stages(pipe):
    out = pipe.cram("sweep", pipe.config, *GRID).output
    root = pipe.run_dir.parent
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == NAMES
    assert _all_calls(root) == ["alpha"] + ["beta"] * 2 + ["gamma"] * 4  # alpha once, beta once per value
    for name, total in zip(NAMES, (111, 211, 121, 221)):
        assert (
            test_runner.json.loads((root / name / "manifest.json").read_text())["stages"]["gamma"]["outputs"]["total"]
            == total
        )
    table = out[out.index("sweep") :]
    assert "beta.value" in table and "gamma.value" in table and "total" in table
    for name, total in zip(NAMES, ("111", "211", "121", "221")):
        row = next(line for line in table.splitlines() if name in line)
        assert total in row and "done" in row


def test_rerunning_a_sweep_skips_finished_variants_and_resumes_an_interrupted_one(pipe, monkeypatch):
    monkeypatch.setattr(test_runner.runner, "default_stages", lambda: fake_stages.modules(resumable_beta=True))
    pipe.cram("sweep", pipe.config, "--grid", "beta.value=10,20")
    root = pipe.run_dir.parent
    for log in root.glob("*/calls.log"):
        log.unlink()
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    out = pipe.cram("sweep", pipe.config, "--grid", "beta.value=10,20,30", code=130).output
    assert "1/3 t-value_10: done" in out and "2/3 t-value_20: done" in out
    assert "run the same `cram sweep` command" in out
    monkeypatch.delenv("FAKE_INTERRUPT")
    pipe.cram("sweep", pipe.config, "--grid", "beta.value=10,20,30")
    assert _all_calls(root) == ["beta", "beta", "gamma"]  # only the third, whose beta resumed
    record = test_runner.json.loads((root / "t-value_30" / "manifest.json").read_text())["stages"]["beta"]
    assert record["outputs"]["attempts"] == 2


def test_a_failing_variant_does_not_stop_the_others(pipe):
    out = pipe.cram("sweep", pipe.config, "--grid", "gamma.fail='',\"crash\"", code=1).output
    assert "1 of 2 variants failed: t-fail_crash" in out
    done = test_runner.json.loads((pipe.run_dir.parent / "t-fail_x" / "manifest.json").read_text())
    assert done["stages"]["gamma"]["status"] == "done"


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("beta.valeu=1,2", "unknown key 'valeu'; did you mean 'value'?"),
        ("beta.value=1,x", "--grid beta.value=x: beta.value: expected an integer, got 'x'"),
        ("betta.value=1", "unknown section [betta]; did you mean 'beta'?"),
        ("beta.value", "expected section.key=V1,V2"),
        ("beta.value=1,,2", "expected section.key=V1,V2"),
        ("beta.value=1,1", "repeated"),
        ("run.name=a,b", "names and places its runs itself"),
    ],
)
def test_a_bad_grid_is_exit_2_before_anything_runs(pipe, grid, message):
    out = pipe.cram("sweep", pipe.config, "--grid", "gamma.value=1,2", "--grid", grid, code=2).output
    assert message in out.replace("\n", "")
    assert not pipe.run_dir.parent.exists()


def test_names_are_deterministic_valid_and_distinct():
    labels = sweep._labels(["pretrain.optimizer.lr", "evaluate.lr", "pretrain.model.layers"])
    assert labels == {
        "pretrain.optimizer.lr": "optimizer.lr",
        "evaluate.lr": "evaluate.lr",
        "pretrain.model.layers": "layers",
    }
    assert sweep._name("default", {"a.lr": "lr"}, {"a.lr": "1e-3"}) == "default-lr_1e-3"
    assert sweep._name("d", {"a.x": "x"}, {"a.x": '"rope"'}) == "d-x_rope"
    assert sweep._split('1,[2, 3],"a,b"') == ["1", "[2, 3]", '"a,b"']


def test_values_that_name_the_same_get_a_digest(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(fake_stages.PIPELINE.format(root=tmp_path / "runs"))
    found = sweep.variants(path, CLASSES, sweep.parse_grid(["alpha.tags=['a b'],['a_b']"]))
    names = [v.name for v in found]
    assert len(set(names)) == 2 and all(n.startswith("t-tags_a_b-") for n in names)
    assert [v.config.stages["alpha"].tags for v in found] == [("a b",), ("a_b",)]
    with pytest.raises(cfg.ConfigError, match="given twice"):
        sweep.parse_grid(["alpha.value=1", "alpha.value=2"])


def test_a_variant_another_process_is_running_is_left_to_it(pipe):
    busy = pipe.run_dir.parent / NAMES[0]
    busy.mkdir(parents=True)
    (busy / ".lock").write_text(
        test_runner.json.dumps({"pid": test_runner.os.getpid(), "host": test_runner.os.uname().nodename})
    )
    out = pipe.cram("sweep", pipe.config, *GRID).output
    assert f"{NAMES[0]}: in use by pid {test_runner.os.getpid()}" in out
    assert "1 variant(s) run by another process" in out
    assert _all_calls(pipe.run_dir.parent) == ["alpha", "beta", "beta", "gamma", "gamma", "gamma"]


def test_a_dry_run_says_which_variant_makes_each_shared_stage_and_runs_nothing(pipe):
    out = pipe.cram("sweep", pipe.config, *GRID, "--dry-run").output
    assert not pipe.run_dir.parent.exists()
    assert f"2/4 {NAMES[1]}: gamma to run; alpha, beta from the store" in out
    reasons = test_runner._reasons(out[out.index(f"4/4 {NAMES[3]}") :])
    assert reasons == {
        "alpha": ("reuse", f"made by {NAMES[0]}"),
        "beta": ("reuse", f"made by {NAMES[2]}"),
        "gamma": ("run", "new"),
    }
