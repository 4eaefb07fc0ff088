"""The shared readers and writers: the atomic write, the file fingerprint, the number check, the
manifest's records, `model.json` as a ModelConfig, a store entry's file against its recorded hash, and
the masking settings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

import pytest

from cram.model.config import ModelConfig, ModelConfigError
from cram.pipeline import rundir, store
from cram.pipeline.schema import StageRecord
from cram.stages.shared.figures import is_number
from cram.stages.shared.files import atomic, files_under, fingerprint, temp_path, write_atomic
from cram.stages.shared.masking import Masking
from cram.stages.shared.store_entry import DAMAGED, MARKER, Marker, read_marker, stored_damage


def test_an_atomic_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    write_atomic(path, "new ½\n")
    assert path.read_text(encoding="utf-8") == "new ½\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic(path) as tmp:
            tmp.write_text("half of the ne")
            raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    with pytest.raises(TypeError):
        write_atomic(path, b"bytes are not text")  # type: ignore[arg-type]
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_the_temporary_path_is_a_hidden_sibling_named_by_the_process(tmp_path):
    tmp = temp_path(tmp_path / "manifest.json")
    assert tmp.parent == tmp_path and tmp.name == f".manifest.json.{os.getpid()}.tmp"


def test_a_fingerprint_is_path_size_and_mtime_and_changes_with_the_file(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("22")
    (tmp_path / "one.txt").write_text("1")
    found = files_under(tmp_path)
    assert found == [tmp_path / "b" / "two.txt", tmp_path / "one.txt"]  # sorted paths, files only
    before = fingerprint(found)
    assert before == [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in found]
    (tmp_path / "one.txt").write_text("10")
    assert fingerprint(found) != before


@pytest.mark.parametrize("value", [0, 3, -2.5, 1e300, 10**400])
def test_a_number_is_an_int_or_a_finite_float(value):
    assert is_number(value)


@pytest.mark.parametrize("value", [True, False, float("nan"), float("inf"), -float("inf"), "3", None, [1]])
def test_flags_nan_infinity_and_non_numbers_are_not_numbers(value):
    assert not is_number(value)


def test_records_are_the_stages_of_a_manifest_and_name_the_file_when_missing_or_broken(tmp_path):
    with pytest.raises(rundir.RunDirError, match=f"^{tmp_path}: no manifest.json; not a run directory$"):
        rundir.records(tmp_path)
    (tmp_path / rundir.MANIFEST).write_text(json.dumps({"stages": {"tokenize": {"status": "done"}}}))
    assert rundir.records(tmp_path) == {"tokenize": StageRecord(status="done")}
    (tmp_path / rundir.MANIFEST).write_text("{")
    with pytest.raises(rundir.RunDirError, match="manifest.json: not valid JSON"):
        rundir.records(tmp_path)


def test_a_lock_file_names_this_process(tmp_path):
    path = tmp_path / rundir.LOCK
    path.write_text(rundir.holder_record())
    holder = rundir.read_lock(path)
    assert holder["pid"] == os.getpid() and rundir.holder_state(holder) == "live"


def test_model_json_loads_back_and_a_missing_field_takes_its_default(tmp_path):
    cfg = ModelConfig(vocab_size=200, hidden=32, layers=2, heads=4, intermediate=64, position="rope")
    path = tmp_path / "model.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    assert ModelConfig.from_json(path) == cfg
    path.write_text(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "dropout"}))
    assert ModelConfig.from_json(path).dropout == ModelConfig.dropout
    path.write_text(json.dumps({**dataclasses.asdict(cfg), "norm_eps": 1, "position_scale": None}))
    assert ModelConfig.from_json(path).norm_eps == 1.0  # an integer where a float belongs is a number
    # A model.json written while the removed switches existed names them off: it loads as the same model.
    path.write_text(json.dumps({**dataclasses.asdict(cfg), "value_residual": False, "activation": "gelu"}))
    assert ModelConfig.from_json(path) == cfg


@pytest.mark.parametrize(
    "content, message",
    [
        ({"hidden": 32, "heads": 4, "attention_window": 128}, "unknown key 'attention_window'"),
        ({"hidden": 30, "heads": 4}, "model.heads=4: must divide model.hidden=30"),
        ([1, 2], "a JSON object of fields expected"),
        ({"hidden": "32"}, 'hidden="32"; expected int'),
        ({"layers": 2.0}, "layers=2.0; expected int"),
        ({"glu": 1}, "glu=1; expected bool"),
        ({"norm_eps": True}, "norm_eps=true; expected float"),
        ({"position": "alibi"}, "position=\"alibi\"; expected one of 'sinusoidal', 'learned', 'rope'"),
        ({"position_scale": "x"}, 'position_scale="x"; expected float | None'),
        (
            {"value_residual": True},
            "value_residual=true: a switch this version no longer builds; only value_residual=false",
        ),
        ({"activation": "silu"}, 'activation="silu": a switch this version no longer builds; only activation="gelu"'),
        ("{", "Expecting property name"),
    ],
)
def test_a_bad_model_json_is_refused_in_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "model.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ModelConfigError) as error:
        ModelConfig.from_json(path)
    assert str(error.value).startswith(f"{path}: not a readable model config (") and message in str(error.value)
    assert "\n" not in str(error.value)
    with pytest.raises(ModelConfigError, match="model.json: not a readable model config"):
        ModelConfig.from_json(tmp_path / "missing" / "model.json")


def test_a_store_entrys_file_is_checked_against_the_hash_its_marker_recorded(tmp_path):
    entry = tmp_path / "pretrain-key"
    entry.mkdir()
    (entry / "params.safetensors").write_bytes(b"weights")
    (entry / "model.json").write_text("{}")
    store.write_marker(entry, "pretrain", "k" * 64, StageRecord())
    assert stored_damage(entry / "params.safetensors") is None
    stat = (entry / "params.safetensors").stat()
    (entry / "params.safetensors").write_bytes(b"weighTs")  # same size, time set back: only the hash tells
    os.utime(entry / "params.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert stored_damage(entry / "params.safetensors") == (
        f"{entry / 'params.safetensors'}: damaged, its sha256 is not the one its store entry recorded"
    )
    assert stored_damage(entry / "model.json") is None
    (entry / DAMAGED).write_text("model.json: damaged\n")  # a note an earlier check left
    assert stored_damage(entry / "model.json") == "model.json: damaged"
    (tmp_path / "loose.bin").write_bytes(b"x")  # no entry around it: nothing recorded, nothing to check
    assert stored_damage(tmp_path / "loose.bin") is None


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(mask_token=0.0, random_token=0.0), "0 and 0 leave every selected token as it was"),
        (dict(mask_token=0.6, random_token=0.5), "must be >= 0 with sum <= 1"),
        (dict(rate=1.0), "rate: 1.0 must be in (0, 1)"),
    ],
)
def test_masking_that_hides_nothing_or_more_than_all_is_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Masking(**fields)
    assert Masking(mask_token=0.0, random_token=0.1).random_token == 0.1  # random tokens alone still hide


def test_a_store_entrys_marker_is_written_and_read_by_one_module(tmp_path):
    """The marker's JSON fields (which runs made before this module wrote too), read back as written; a
    marker that cannot be read is none."""
    entry = tmp_path / "pack-key"
    (entry / "sub").mkdir(parents=True)
    (entry / "train.npy").write_bytes(b"rows")
    (entry / "sub" / "x.json").write_text("{}")
    (entry / DAMAGED).write_text("not a file of the entry\n")
    written = Marker.of_files(entry, "pack", "k" * 64, {"status": "done"})
    written.write(entry)
    raw = json.loads((entry / MARKER).read_text(encoding="utf-8"))
    assert list(raw) == ["stage", "key", "record", "files", "mtime_ns", "sha256"]
    assert raw["files"] == {"sub/x.json": 2, "train.npy": 4}
    assert raw["sha256"]["train.npy"] == hashlib.sha256(b"rows").hexdigest()
    assert read_marker(entry) == written
    sizes_only = {k: raw[k] for k in ("stage", "key", "record", "files")}  # as written before hashes
    (entry / MARKER).write_text(json.dumps(sizes_only))
    assert read_marker(entry) == Marker("pack", "k" * 64, {"status": "done"}, raw["files"])
    for broken in ("[", "[]", "\xff"):
        (entry / MARKER).write_text(broken, encoding="latin-1")
        assert read_marker(entry) is None
    assert read_marker(tmp_path) is None
