"""The typed manifest (pipeline/schema.py): manifests and store markers written before it still read, and
write back the same records; a field of the wrong type or a newer schema is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_runner import _reasons, pipe  # noqa: F401  (the fixture)

from cram.pipeline import rundir, store
from cram.pipeline.schema import SCHEMA, StageRecord, Try

# manifest.json files and a store marker exactly as c0db683 wrote them (tests/fake_stages.py's run):
# kept-attempts: beta and gamma done, each with a failed attempt at another key kept beside it;
# reused: every stage linked from the store; interrupted: beta stopped by Ctrl-C; killed: beta's
# process killed while it ran (the record still says running).
OLD = Path(__file__).parent / "manifests"


def _load(name: str, tmp_path: Path) -> rundir.Manifest:
    run_dir = tmp_path / name
    run_dir.mkdir()
    shutil.copyfile(OLD / f"{name}.json", run_dir / rundir.MANIFEST)
    return rundir.Manifest.load(run_dir)


def test_manifests_written_before_the_schema_read_as_typed_records(tmp_path):
    kept = _load("kept-attempts", tmp_path).records
    assert [r.status for r in kept.values()] == ["done"] * 3
    assert (
        kept["beta"].attempt == StageRecord(**{**vars(kept["beta"].attempt)})
        and kept["beta"].attempt.status == "failed"
    )
    assert kept["beta"].attempt.error == "RuntimeError: boom" and kept["gamma"].attempt.attempts[0].status == "failed"
    assert kept["gamma"].outputs == {"result": "result.json", "total": 111, "attempts": 1}
    assert kept["beta"].upstream_keys == {"alpha": kept["alpha"].key} and kept["alpha"].attempt is None
    assert kept["alpha"].attempts == (Try("2026-12-04T17:36:24.860+00:00", "2026-12-04T17:36:24.877+00:00", 0.017),)
    reused = _load("reused", tmp_path).records
    assert all(r.reused for r in reused.values()) and reused["gamma"].key == kept["gamma"].key
    interrupted = _load("interrupted", tmp_path).stage("beta")
    assert (interrupted.status, interrupted.error, interrupted.pid) == ("interrupted", "interrupted (Ctrl-C)", 12370)
    killed = _load("killed", tmp_path).stage("beta")
    assert (killed.status, killed.attempts, killed.ended, killed.duration_s) == ("running", (), None, None)


@pytest.mark.parametrize("name", ["kept-attempts", "reused", "interrupted", "killed"])
def test_an_old_manifest_saved_again_holds_the_same_records_and_the_schema(name, tmp_path):
    manifest = _load(name, tmp_path)
    manifest.save()
    written = json.loads(manifest.path.read_text())
    assert written == {"schema": SCHEMA, **json.loads((OLD / f"{name}.json").read_text())}
    for stage, record in written["stages"].items():  # the fields in the order they were written before
        assert list(record) == list(json.loads((OLD / f"{name}.json").read_text())["stages"][stage])


def test_an_old_store_marker_gives_the_record_of_the_run_that_made_it(tmp_path):
    entry = tmp_path / "beta-entry"
    entry.mkdir()
    shutil.copyfile(OLD / "entry-marker.json", entry / store.MARKER)
    record = store.entry_record(entry)
    assert record.status == "done" and record.outputs["total"] == 11 and record.versions["torch"] == "2.13.0+cpu"


def test_an_interrupted_old_run_resumes_and_adds_up_its_tries(pipe, monkeypatch):  # noqa: F811
    pipe.run_dir.mkdir(parents=True)
    shutil.copyfile(OLD / "interrupted.json", pipe.run_dir / rundir.MANIFEST)
    overrides = ("--set", "alpha.value=2")  # the config that run had
    assert _reasons(pipe.run(*overrides, "--dry-run").output)["beta"] == ("run", "incomplete")
    pipe.run(*overrides)
    beta = rundir.Manifest.load(pipe.run_dir).stage("beta")
    assert [t.status for t in beta.attempts] == ["interrupted", "done"] and beta.status == "done"
    assert beta.duration_s == pytest.approx(0.029 + beta.attempts[1].duration_s, abs=1e-3)


def test_a_killed_old_run_counts_the_try_it_could_not_close(pipe):  # noqa: F811
    pipe.run_dir.mkdir(parents=True)
    shutil.copyfile(OLD / "killed.json", pipe.run_dir / rundir.MANIFEST)
    pipe.run("--set", "alpha.value=3")
    beta = rundir.Manifest.load(pipe.run_dir).stage("beta")
    assert [t.status for t in beta.attempts] == ["killed", "done"] and beta.attempts[0].duration_s is None
    assert beta.duration_s == beta.attempts[1].duration_s


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"schema": SCHEMA + 1}, f"manifest schema {SCHEMA + 1}; this cram reads schemas 1 to {SCHEMA}"),
        ({"stages": {"beta": {"status": "paused"}}}, "stages.beta.status: expected one of running, done, failed"),
        ({"stages": {"beta": {"attempts": [{"duration_s": "long"}]}}}, "stages.beta.attempts[0].duration_s: expected"),
        (
            {"stages": {"beta": {"attempt": {"pid": "x"}}}},
            'stages.beta.attempt.pid: expected an integer or null, got "x"',
        ),
        ({"stages": {"beta": {"upstream_keys": {"alpha": 3}}}}, "stages.beta.upstream_keys: expected strings by name"),
    ],
)
def test_a_newer_schema_or_a_field_of_the_wrong_type_is_refused_by_name(edit, message, tmp_path):
    (tmp_path / rundir.MANIFEST).write_text(json.dumps({"run": "t", "stages": {}, **edit}))
    with pytest.raises(rundir.RunDirError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rundir.Manifest.load(tmp_path)
