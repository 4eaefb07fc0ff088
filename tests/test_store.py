"""The stage store on the fake stages: reuse across runs, per-key locking, trust, failed re-runs, gc."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fake_stages
import pytest
import test_runner
from test_runner import TESTS, _reasons

from cram.pipeline import planning, rundir, runner, store
from cram.pipeline.schema import StageRecord

pipe = test_runner.pipe  # the fixture: cram on the fake stages in a temporary folder


def _entry(pipe, stage: str) -> Path:
    return (pipe.run_dir / stage).resolve()


def _calls(run_dir: Path) -> list[str]:
    log = run_dir / "calls.log"
    return log.read_text().split() if log.exists() else []


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / rundir.MANIFEST).read_text())["stages"]


def test_a_second_run_name_reuses_every_stage_from_the_store(pipe):
    pipe.run()
    other = pipe.run_dir.parent / "other"
    dry = pipe.run("--name", "other", "--dry-run").output
    assert _reasons(dry) == {s: ("reuse", "in store") for s in ("alpha", "beta", "gamma")}
    pipe.run("--name", "other")
    assert _calls(other) == []  # nothing computed again
    records = _manifest(other)
    assert [r["status"] for r in records.values()] == ["done"] * 3
    assert records["gamma"]["outputs"]["total"] == 111 and records["gamma"]["reused"]
    assert records["gamma"]["git_commit"] == pipe.manifest()["gamma"]["git_commit"]  # how it was made
    assert (other / "gamma").resolve() == _entry(pipe, "gamma")
    assert json.loads((other / "gamma" / "result.json").read_text()) == {"total": 111}
    assert "done" in pipe.cram("status", other).output


def test_only_a_later_stage_in_a_new_run_links_its_upstream_and_nothing_else(pipe):
    pipe.run()
    other = pipe.run_dir.parent / "other"
    assert _reasons(pipe.run("--name", "other", "--only", "beta", "--dry-run").output) == {
        "alpha": ("reuse", "in store"),
        "beta": ("reuse", "in store"),
        "gamma": ("skip", "not selected"),
    }
    pipe.run("--name", "other", "--only", "beta")
    assert _calls(other) == [] and set(_manifest(other)) == {"alpha", "beta"}


def test_changing_a_config_keeps_the_earlier_result_and_returning_to_it_is_instant(pipe):
    pipe.run()
    pipe.calls()
    first = _entry(pipe, "beta")
    pipe.run("--set", "beta.value=20")
    assert pipe.calls() == ["beta", "gamma"]
    assert first.is_dir() and _entry(pipe, "beta") != first  # the earlier entry is still in the store
    assert _reasons(pipe.run("--dry-run").output)["beta"] == ("reuse", "in store")
    pipe.run()
    assert pipe.calls() == []
    assert _entry(pipe, "beta") == first and pipe.manifest()["gamma"]["outputs"]["total"] == 111


def test_two_processes_on_one_key_compute_it_once(pipe, tmp_path):
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import fake_stages; "
        "from cram.pipeline import runner; from cram.pipeline.commands import cli; "
        "runner.default_stages = fake_stages.modules; "
        "sys.argv = ['cram', 'run', sys.argv[2], '--name', sys.argv[3]]; cli.main()"
    )
    env = {**os.environ, "FAKE_SLOW": "beta"}

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", script, str(TESTS), str(pipe.config), name],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = start("a")
    deadline = time.time() + 60
    while not list((tmp_path / "runs" / store.STORE).glob("beta-*.partial/attempts")):
        assert first.poll() is None and time.time() < deadline, "the first runner never reached beta"
        time.sleep(0.05)
    second = start("b")
    outputs = [p.communicate(timeout=60)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    runs = tmp_path / "runs"
    assert _calls(runs / "a") == ["alpha", "beta", "gamma"]
    assert _calls(runs / "b") == []  # it waited for beta's key, then linked all three
    assert "waiting for another process computing the same key" in outputs[1]
    assert _manifest(runs / "b")["gamma"]["outputs"]["total"] == 111
    assert not list((runs / store.STORE).glob("*.partial")) and not list((runs / store.STORE).glob("*.lock"))


def test_an_entry_whose_files_were_deleted_is_not_trusted_and_is_recomputed(pipe):
    pipe.run()
    pipe.calls()
    (_entry(pipe, "beta") / "result.json").unlink()
    assert "missing" in pipe.cram("status", pipe.run_dir).output
    assert _reasons(pipe.run("--dry-run").output)["beta"] == ("run", "files missing")
    assert _reasons(pipe.run("--name", "other", "--dry-run").output)["beta"] == ("run", "new")
    pipe.run()
    assert pipe.calls() == ["beta"]  # gamma's key is unchanged: its entry is still good
    assert json.loads((pipe.run_dir / "beta" / "result.json").read_text()) == {"total": 11}
    shutil.rmtree(_entry(pipe, "gamma"))  # the whole entry gone: the run's link dangles
    status = pipe.cram("status", pipe.run_dir).output
    assert "missing" in status and "does not exist" in status
    pipe.run()
    assert pipe.calls() == ["gamma"]


def test_a_failed_rerun_keeps_the_earlier_done_record_and_files(pipe):
    pipe.run()
    pipe.calls()
    before = pipe.manifest()
    files = {s: (pipe.run_dir / s / "result.json").read_text() for s in before}
    for fail, code in (("input", 2), ("crash", 1)):
        pipe.run("--set", "beta.value=20", "--set", f"beta.fail='{fail}'", code=code)
        after = pipe.manifest()
        for stage in before:
            assert {k: v for k, v in after[stage].items() if k != "attempt"} == before[stage]
            assert (pipe.run_dir / stage / "result.json").read_text() == files[stage]
        assert after["beta"]["attempt"]["status"] == "failed" and after["beta"]["attempt"]["error"]
        assert "kept" in pipe.cram("status", pipe.run_dir).output
    assert _reasons(pipe.run("--dry-run").output) == {s: ("skip", "done") for s in before}
    pipe.run("--set", "beta.value=20")
    assert "attempt" not in pipe.manifest()["beta"] and pipe.manifest()["gamma"]["outputs"]["total"] == 121


def test_fields_a_stage_declares_not_in_key_keep_its_key_and_resume_its_partial(pipe, monkeypatch):
    def modules():
        found = fake_stages.modules(resumable_beta=True)
        found[1].NOT_IN_KEY = ("tags",)
        return found

    monkeypatch.setattr(runner, "default_stages", modules)
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    pipe.run(code=130)
    monkeypatch.delenv("FAKE_INTERRUPT")
    assert _reasons(pipe.run("--set", "beta.tags=['x']", "--dry-run").output)["beta"] == ("run", "incomplete")
    pipe.run("--set", "beta.tags=['x']")
    assert pipe.manifest()["beta"]["outputs"]["attempts"] == 2  # resumed, not restarted
    assert _reasons(pipe.run("--dry-run").output)["beta"] == ("skip", "done")


def test_an_interrupted_partial_of_another_config_is_kept_and_resumed_on_return(pipe, monkeypatch):
    monkeypatch.setattr(runner, "default_stages", lambda: fake_stages.modules(resumable_beta=True))
    monkeypatch.setenv("FAKE_INTERRUPT", "beta")
    pipe.run(code=130)
    monkeypatch.delenv("FAKE_INTERRUPT")
    out = pipe.run("--set", "beta.value=20").output
    assert "unfinished attempt with another config is kept" in out
    assert len(list((pipe.run_dir.parent / store.STORE).glob("beta-*.partial"))) == 1
    pipe.run()  # back to the first config: its partial is continued
    assert pipe.manifest()["beta"]["outputs"]["attempts"] == 2


def test_pretrain_logging_and_checkpoint_cadence_are_not_in_its_key():
    from cram.stages import pretrain

    names = {f.name for f in pretrain.dataclasses.fields(pretrain.Config)}
    assert set(pretrain.NOT_IN_KEY) <= names
    base = planning.keyed_config(pretrain, pretrain.Config())
    cadence = pretrain.Config(
        log_every_steps=1, checkpoint_every_minutes=0.5, checkpoint_every_steps=7, keep_checkpoints=5
    )
    assert planning.keyed_config(pretrain, cadence) == base
    assert planning.keyed_config(pretrain, pretrain.Config(microbatch=16)) != base


def test_tokenize_processes_and_batch_size_are_not_in_its_key():
    from cram.stages import tokenize

    base = planning.keyed_config(tokenize, tokenize.Config())
    assert planning.keyed_config(tokenize, tokenize.Config(num_proc=3, batch_size=17)) == base
    assert planning.keyed_config(tokenize, tokenize.Config(vocab_size=4096)) != base


def test_gc_removes_exactly_what_no_run_refers_to(pipe):
    pipe.run()
    pipe.calls()
    dropped = pipe.run_dir.parent / "dropped"
    pipe.run("--name", "dropped", "--set", "gamma.value=200")
    only_dropped = _entry(pipe, "gamma").with_name((dropped / "gamma").resolve().name)
    shutil.rmtree(dropped)
    root = pipe.run_dir.parent
    dry = pipe.cram("gc", root, "--dry-run").output
    assert f"would remove {only_dropped}" in dry and "would remove 1 store item(s)" in dry
    assert only_dropped.is_dir()
    out = pipe.cram("gc", root).output
    assert f"removed {only_dropped}" in out and not only_dropped.exists()
    assert {p.name for p in (root / store.STORE).iterdir()} == {
        (pipe.run_dir / s).resolve().name for s in ("alpha", "beta", "gamma")
    }
    assert "nothing to remove" in pipe.cram("gc", root).output
    pipe.run()
    assert pipe.calls() == []


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the store lock `path`, as a runner computing that key does."""
    script = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_gc_keeps_a_key_being_written_and_an_attempt_a_run_may_resume(pipe):
    pipe.run()
    shop = pipe.run_dir.parent / store.STORE
    key = "f" * 64
    (shop / f"beta-{key}.partial").mkdir()
    writer = _hold_lock(shop / f"beta-{key}.lock")
    try:
        for args in ((), ("--dry-run",)):
            out = pipe.cram("gc", pipe.run_dir.parent, *args).output
            assert "being written" in out and (shop / f"beta-{key}.partial").is_dir()
    finally:
        writer.kill()
        writer.wait()
    manifest = rundir.Manifest.load(pipe.run_dir)
    manifest.update("beta", attempt=StageRecord(key=key, status="interrupted"))
    pipe.cram("gc", pipe.run_dir.parent)
    assert (shop / f"beta-{key}.partial").is_dir()  # the run's attempt refers to it: resumable
    manifest.update("beta", attempt=None)
    out = pipe.cram("gc", pipe.run_dir.parent).output
    assert not (shop / f"beta-{key}.partial").exists() and "removed 1 store item(s)" in out
    assert not (shop / f"beta-{key}.lock").exists()  # the killed writer's lock went with it


def test_a_store_lock_is_held_by_one_process_and_released_when_it_dies(tmp_path):
    path = tmp_path / "k.lock"
    holder = _hold_lock(path)
    try:
        assert store.take_lock(path, None, wait=False) is None
    finally:
        holder.kill()
        holder.wait()
    fd = store.take_lock(path, None, wait=False)  # the kernel let go of the dead holder's lock
    assert fd is not None and json.loads(path.read_text())["pid"] == os.getpid()
    os.close(fd)


def test_gc_refuses_when_a_manifest_cannot_be_read(pipe):
    pipe.run()
    bad = pipe.run_dir.parent / "bad"
    bad.mkdir()
    (bad / rundir.MANIFEST).write_text("{not json")
    out = pipe.cram("gc", pipe.run_dir.parent, code=2).output
    assert "not valid JSON" in out and "nothing was removed" in out


@pytest.mark.parametrize("content", ["", '{"pid": 12', "[]"])
def test_an_empty_or_half_written_lock_is_taken_over_with_a_clear_message(pipe, content):
    pipe.run_dir.mkdir(parents=True)
    (pipe.run_dir / rundir.LOCK).write_text(content)
    out = pipe.run().output
    assert "taking over a lock without a pid" in out and "None" not in out
    assert pipe.calls() == ["alpha", "beta", "gamma"]
    assert not (pipe.run_dir / rundir.LOCK).exists()


def test_status_shows_a_killed_run_as_killed(pipe):
    pipe.run("--set", "gamma.fail='crash'", code=1)
    gone = subprocess.Popen(["true"])
    gone.wait()
    manifest = rundir.Manifest.load(pipe.run_dir)
    manifest.update("gamma", status="running", pid=gone.pid, host=os.uname().nodename, error=None)
    status = pipe.cram("status", pipe.run_dir).output
    assert "killed" in status and "running" not in status
    manifest.update("gamma", pid=os.getpid())  # alive: still running
    assert "running" in pipe.cram("status", pipe.run_dir).output


def test_a_copied_run_dir_works_when_copied_with_its_files_and_says_what_is_missing_otherwise(pipe, tmp_path):
    pipe.run()
    pipe.calls()
    whole = tmp_path / "copy-L" / "t"
    shutil.copytree(pipe.run_dir, whole, symlinks=False)  # cp -rL: the entries' files, not the links
    assert "missing" not in pipe.cram("status", whole).output
    pipe.cram("run", pipe.config, "--set", f"run.root='{whole.parent}'")
    assert _calls(whole) == []  # all done in the copy
    linked = tmp_path / "copy-links" / "t"
    shutil.copytree(pipe.run_dir, linked, symlinks=True)  # cp -r: links into a store that is not there
    status = pipe.cram("status", linked).output
    assert status.count("missing") == 3 and "does not exist" in status
    pipe.cram("run", pipe.config, "--set", f"run.root='{linked.parent}'")
    assert _calls(linked) == ["alpha", "beta", "gamma"]  # made again in the new root's store


def test_a_run_made_before_the_store_is_trusted_and_its_folders_move_into_the_store_when_replaced(pipe):
    pipe.run()
    pipe.calls()
    for stage in ("alpha", "beta", "gamma"):  # the layout before the store: real folders, no marker
        entry = _entry(pipe, stage)
        (pipe.run_dir / stage).unlink()
        shutil.copytree(entry, pipe.run_dir / stage, ignore=shutil.ignore_patterns(store.MARKER))
    shutil.rmtree(pipe.run_dir.parent / store.STORE)
    assert _reasons(pipe.run("--dry-run").output) == {s: ("skip", "done") for s in ("alpha", "beta", "gamma")}
    pipe.run("--set", "beta.value=20")
    assert pipe.calls() == ["beta", "gamma"]
    assert (pipe.run_dir / "beta").is_symlink() and (pipe.run_dir / "alpha").is_dir()
    pipe.run()  # back to the first config: the old folders were kept in the store, under their keys
    assert pipe.calls() == []
    assert json.loads((pipe.run_dir / "beta" / "result.json").read_text()) == {"total": 11}
    stray = pipe.run_dir / "gamma"
    stray.unlink()
    stray.mkdir()
    manifest = rundir.Manifest.load(pipe.run_dir)
    manifest.put("gamma", StageRecord(status="done"))
    out = pipe.run(code=2).output
    assert "cram did not make it: move it away" in out and stray.is_dir()


def test_a_forced_rerun_replaces_the_entry_and_leaves_the_old_one_to_gc(pipe):
    pipe.run()
    pipe.run("--name", "other")
    pipe.calls()
    pipe.run("--force", "beta")
    assert pipe.calls() == ["beta"]
    other = pipe.run_dir.parent / "other"
    assert (other / "beta").resolve() == _entry(pipe, "beta")  # both runs see the new entry
    assert json.loads((other / "beta" / "result.json").read_text()) == {"total": 11}
    retired = list((pipe.run_dir.parent / store.STORE).glob("beta-*.retired-*"))
    assert len(retired) == 1
    out = pipe.cram("gc", pipe.run_dir.parent).output
    assert f"removed {retired[0]}" in out and "removed 1 store item(s)" in out
    assert "missing" not in pipe.cram("status", other).output


def test_a_result_kept_after_its_upstream_changed_says_so_and_keeps_what_it_was_made_from(pipe):
    pipe.run()
    first_beta = _entry(pipe, "beta")
    pipe.run("--set", "beta.value=20", "--set", "gamma.fail='crash'", code=1)
    records = pipe.manifest()
    assert records["beta"]["outputs"]["total"] == 21 and records["gamma"]["outputs"]["total"] == 111
    assert records["gamma"]["upstream_keys"]["beta"] == first_beta.name.split("-", 1)[1]
    status = pipe.cram("status", pipe.run_dir).output
    assert "made from an earlier beta" in status and "this result is kept" in status
    pipe.cram("gc", pipe.run_dir.parent)
    assert first_beta.is_dir()  # the params gamma describes are kept while gamma's record is


def _damage_keeping_time(path: Path) -> None:
    """Change a byte of `path` but keep its size and modification time: what a plan cannot see."""
    stat = path.stat()
    data = path.read_bytes()
    path.write_bytes(data[:-2] + bytes([data[-2] ^ 1]) + data[-1:])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_damaged_entry_is_computed_again_not_linked_into_another_run(pipe):
    pipe.run()
    pipe.calls()
    _damage_keeping_time(_entry(pipe, "beta") / "result.json")
    other = pipe.run_dir.parent / "other"
    assert _reasons(pipe.run("--name", "other", "--dry-run").output)["beta"] == ("reuse", "in store")
    out = pipe.run("--name", "other").output
    assert "a damaged store entry is computed again" in out and "result.json: damaged" in out
    assert _calls(other) == ["beta"]  # linking means reading: hashed first, then computed; gamma still linked
    assert json.loads((other / "beta" / "result.json").read_text()) == {"total": 11}
    assert _reasons(pipe.run("--dry-run").output)["beta"] == ("skip", "done")  # the first run's link: the new entry
    assert len(list((pipe.run_dir.parent / store.STORE).glob("beta-*.retired-*"))) == 1  # the damaged one, for gc


def test_each_entry_records_sizes_times_and_hashes_and_a_copy_is_hashed_once(pipe, tmp_path, monkeypatch):
    pipe.run()
    marker = store.read_marker(_entry(pipe, "beta"))
    result = _entry(pipe, "beta") / "result.json"
    assert set(marker.sizes) == set(marker.hashes) == set(marker.times) == {"attempts", "result.json"}
    assert marker.sizes["result.json"] == result.stat().st_size
    assert marker.hashes["result.json"] == hashlib.sha256(result.read_bytes()).hexdigest()
    assert marker.times["result.json"] == result.stat().st_mtime_ns
    copy = tmp_path / "copy" / "t"
    copy.parent.mkdir()
    subprocess.run(["cp", "-rL", str(pipe.run_dir), str(copy)], check=True)  # new files, new times
    again = ["run", pipe.config, "--set", f"run.root='{copy.parent}'", "--dry-run"]
    assert set(_reasons(pipe.cram(*again).output).values()) == {("skip", "done")}  # hashed, found intact
    assert store.read_marker(copy / "beta").times["result.json"] == (copy / "beta/result.json").stat().st_mtime_ns
    monkeypatch.setattr(store, "content_hash", lambda path: pytest.fail(f"{path} hashed again"))
    assert set(_reasons(pipe.cram(*again).output).values()) == {("skip", "done")}  # the new times are recorded


def test_verify_names_what_is_damaged_and_trusts_markers_without_hashes_on_sizes(pipe):
    pipe.run()
    assert "3 of 3 stage output(s) intact" in pipe.cram("verify", pipe.run_dir.parent).output
    _damage_keeping_time(_entry(pipe, "gamma") / "result.json")
    out = pipe.cram("verify", pipe.run_dir.parent, code=1).output
    assert f"damaged: {_entry(pipe, 'gamma')}/result.json: damaged" in out and "2 of 3" in out
    assert "damaged" in pipe.cram("status", pipe.run_dir).output
    assert _reasons(pipe.run("--dry-run").output)["gamma"] == ("run", "files damaged")
    pipe.run()
    marker = _entry(pipe, "alpha") / store.MARKER
    old = {k: v for k, v in json.loads(marker.read_text()).items() if k in ("stage", "key", "record", "files")}
    marker.write_text(json.dumps(old))  # as written before checksums
    _damage_keeping_time(_entry(pipe, "alpha") / "result.json")
    out = pipe.cram("verify", pipe.run_dir).output
    assert "3 of 3 stage output(s) intact (1 made before checksums: sizes checked)" in out
    pipe.cram("verify", pipe.run_dir / "alpha", code=2)


def test_verify_says_missing_for_an_entry_whose_files_were_deleted(pipe):
    pipe.run()
    (_entry(pipe, "beta") / "result.json").unlink()
    out = pipe.cram("verify", pipe.run_dir, code=1).output
    assert f"missing: {pipe.run_dir / 'beta'}/result.json was deleted" in out and "2 of 3" in out


def test_verify_of_a_root_says_missing_for_a_deleted_entry_a_run_links_to(pipe):
    pipe.run()
    shutil.rmtree(_entry(pipe, "beta"))  # the run's beta link now points nowhere
    out = pipe.cram("verify", pipe.run_dir.parent, code=1).output
    assert f"missing: {pipe.run_dir / 'beta'} points to ../.store/beta-" in out, out
    assert "which does not exist" in out and "2 of 3 stage output(s) intact" in out, out
    shutil.copytree(_entry(pipe, "gamma"), pipe.run_dir.parent / "gamma-copy")
    (pipe.run_dir / "gamma").unlink()
    (pipe.run_dir.parent / "gamma-copy").rename(pipe.run_dir / "gamma")  # a real folder: counted once more
    out = pipe.cram("verify", pipe.run_dir.parent, code=1).output
    assert "3 of 4 stage output(s) intact" in out, out


def test_a_new_option_at_its_default_is_left_out_of_the_key_and_in_it_otherwise():
    from cram.stages import load, pretrain

    stage = load("pretrain")
    stage = dataclasses.replace(stage, NEW_OPTIONS=(*stage.NEW_OPTIONS, "masking.rate", "microbatch"))

    base = planning.keyed_config(pretrain, pretrain.Config())
    keyed = planning.keyed_config(stage, pretrain.Config())
    assert "microbatch" not in keyed and "rate" not in keyed["masking"]
    assert {k: v for k, v in base.items() if k not in ("microbatch", "masking")} == {
        k: v for k, v in keyed.items() if k not in ("microbatch", "masking")
    }
    changed = planning.keyed_config(stage, pretrain.Config(microbatch=16))
    assert changed["microbatch"] == 16
