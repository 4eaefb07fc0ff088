"""Checkpoints that survive corruption: checksums written with each, verified before a resume, the
damaged file named, and the newest intact checkpoint used instead."""

import json

import pytest
import structlog
import torch

from cram.stages.pretraining import checkpoint


def _save_three(root):
    for step in (1, 2, 3):
        tensors = {"w": torch.full((64, 64), float(step)), "b": torch.zeros(3)}
        checkpoint.save(root, step, tensors, {"m.w": torch.ones(2)}, {"step": step}, keep=3)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):  # 4 KB of noise in the middle: the file still parses, its numbers are wrong
    data = bytearray(path.read_bytes())
    data[-4096 - 8 : -8] = bytes((i * 37) % 251 for i in range(4096))
    path.write_bytes(bytes(data))


def test_each_checkpoint_has_checksums_of_its_files(tmp_path):
    _save_three(tmp_path)
    sums = json.loads((tmp_path / "step-3" / checkpoint.CHECKSUMS).read_text())
    assert sorted(sums) == sorted([checkpoint.PARAMS, checkpoint.OPTIMIZER, checkpoint.STATE])
    checkpoint.verify(tmp_path / "step-3")


@pytest.mark.parametrize(
    "damage, file",
    [
        (_truncate, checkpoint.PARAMS),
        (_garbage, checkpoint.PARAMS),
        (_truncate, checkpoint.OPTIMIZER),
        (_truncate, checkpoint.STATE),
        (lambda p: p.write_text('{"step": 4}'), checkpoint.STATE),
        (lambda p: p.unlink(), checkpoint.PARAMS),
    ],
)
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_is_used(tmp_path, damage, file):
    _save_three(tmp_path)
    damage(tmp_path / "step-3" / file)
    with pytest.raises(checkpoint.CheckpointError, match=f"step-3/{file}"):
        checkpoint.verify(tmp_path / "step-3")
    with structlog.testing.capture_logs() as logs:
        found = checkpoint.latest(tmp_path, structlog.get_logger())
    assert found == tmp_path / "step-2"
    assert [e["event"] for e in logs] == ["corrupt checkpoint skipped"] and file in logs[0]["error"]
    assert (tmp_path / "step-3.corrupt" / checkpoint.STATE).exists()  # kept for a look, never read again
    params, _, state = checkpoint.load(found)
    assert state == {"step": 2} and torch.equal(params["w"], torch.full((64, 64), 2.0))


def test_every_checkpoint_corrupt_means_a_fresh_start(tmp_path):
    _save_three(tmp_path)
    for step in (1, 2, 3):
        _truncate(tmp_path / f"step-{step}" / checkpoint.PARAMS)
    assert checkpoint.latest(tmp_path) is None


def test_a_checkpoint_without_checksums_is_not_resumed_from(tmp_path):
    _save_three(tmp_path)
    (tmp_path / "step-3" / checkpoint.CHECKSUMS).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="step-3/checksums.json: unreadable"):
        checkpoint.verify(tmp_path / "step-3")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2"


# state.json as the string-keyed state dict of the loop wrote it, before the state was a dataclass.
OLD_STATE_JSON = """{
 "step": 10,
 "sequences": 136,
 "tokens_seen": 4352,
 "elapsed_s": 0.17682863300001372,
 "data_wait_s": 0.0008339570000543972,
 "progress": 1.0,
 "seed": 0,
 "loss_start": 5.525416374206543,
 "loss_end": 5.549246470133464,
 "val_loss_start": 5.5419464111328125,
 "unlogged": [
  [
   5.550357818603516,
   0.0078125,
   0.8546714782714844
  ]
 ]
}"""


def test_a_state_json_in_the_old_dict_form_resumes_and_round_trips(tmp_path):
    from cram.stages.pretraining.state import TrainState

    tensors = {"w": torch.ones(2)}
    old = checkpoint.save(tmp_path / "old", 10, tensors, tensors, json.loads(OLD_STATE_JSON), keep=1)
    assert (old / checkpoint.STATE).read_text() == OLD_STATE_JSON
    params, opt_state, counters = checkpoint.load(old)
    state = TrainState.from_json(counters, params, opt_state)
    assert (state.step, state.sequences, state.seed, state.unlogged) == (
        10,
        136,
        0,
        [[5.550357818603516, 0.0078125, 0.8546714782714844]],
    )
    assert torch.equal(state.params["w"], tensors["w"])
    new = checkpoint.save(tmp_path / "new", state.step, state.params, state.opt_state, state.to_json(), keep=1)
    assert (new / checkpoint.STATE).read_text() == OLD_STATE_JSON
    # A fresh state is the fresh dict the loop started from.
    assert TrainState(seed=3).to_json() == {
        "step": 0,
        "sequences": 0,
        "tokens_seen": 0,
        "elapsed_s": 0.0,
        "data_wait_s": 0.0,
        "progress": 0.0,
        "seed": 3,
        "loss_start": None,
        "loss_end": None,
        "val_loss_start": None,
        "unlogged": [],
    }
