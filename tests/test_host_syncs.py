"""Host syncs off the hot path: the torchrun clock is agreed every N steps, the held-out MLM sums stay on
the device, host-to-device copies are pinned and non-blocking on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cram import model
from cram.stages.pretraining.budget import Clock
from cram.stages.shared.device import to_device
from cram.stages.shared.masking import MaskSpec
from cram.stages.shared.val_mlm import mask_blocks, val_mlm


def test_the_clock_is_agreed_every_n_steps_and_extrapolated_alike_between(monkeypatch):
    readings = iter([0.0, 10.0, 20.0, 30.0])  # rank 0's clock at steps 0, 10, 20, 30: one second a step

    def broadcast(tensor, src):
        tensor.fill_(next(readings))

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    clock = Clock(0.0, agree=True, device=torch.device("cpu"), every=10)
    seen = [clock.agreed(step) for step in range(31)]
    assert clock.syncs == 4  # steps 0, 10, 20, 30; not one per step
    assert seen[10] == 10.0 and seen[15] == 15.0 and seen[25] == 25.0  # the agreed rate, one s/step
    assert seen[5] == 0.0  # before a rate is known, the last agreed reading


def test_an_extrapolation_past_the_budget_is_checked_by_a_real_reading(monkeypatch):
    # Steps 0-10 took 10 s, then the machine got faster: extrapolating 1 s/step would say the 15 s budget
    # is spent at step 15, when rank 0's clock says 12.5 s; training must not stop on the estimate.
    readings = iter([0.0, 10.0, 12.5, 15.0])

    def broadcast(tensor, src):
        tensor.fill_(next(readings))

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    clock = Clock(0.0, agree=True, device=torch.device("cpu"), every=10, end_s=15.0)
    seen = [clock.agreed(step) for step in range(16)]
    assert seen[14] == 14.0 and seen[15] == 12.5 and clock.syncs == 3  # step 15: read, not extrapolated
    assert clock.agreed(16) == 13.0 and clock.syncs == 3  # the new rate, 0.5 s/step, is extrapolated
    assert clock.agreed(20) == 15.0 and clock.syncs == 4  # the estimate reaches the end again: read again


def spec() -> MaskSpec:
    return MaskSpec(per_sequence=4, mask_id=4, vocab_size=64, special_ids=(0, 1, 2, 3, 4))


def test_heldout_masks_do_not_depend_on_the_batch_size():
    blocks = np.random.default_rng(0).integers(5, 64, size=(10, 16))
    whole = mask_blocks(blocks, 0, spec(), seed=0)
    first, rest = mask_blocks(blocks[:3], 0, spec(), seed=0), mask_blocks(blocks[3:], 3, spec(), seed=0)
    assert torch.equal(whole["input_ids"], torch.cat([first["input_ids"], rest["input_ids"]]))
    assert torch.equal(whole["mlm_labels"], torch.cat([first["mlm_labels"], rest["mlm_labels"]]))


def test_heldout_mlm_syncs_with_the_host_once(monkeypatch):
    cfg = model.ModelConfig(vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_seq_len=16)
    params = model.init(cfg, 0)
    step = model.make_eval_step(cfg, compile=False)
    blocks = np.random.default_rng(0).integers(5, 64, size=(10, 16))
    expected = val_mlm(step, params, blocks, spec(), seed=0, batch_size=3, device=torch.device("cpu"))
    one_batch = val_mlm(step, params, blocks, spec(), seed=0, batch_size=10, device=torch.device("cpu"))
    assert one_batch["loss"] == pytest.approx(expected["loss"], rel=1e-5)  # same masks, any batch size

    syncs = []
    for name in ("item", "tolist", "__float__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _real=real, _n=name, **k: (syncs.append(_n), _real(self, *a, **k))[1]
        )
    val_mlm(step, params, blocks, spec(), seed=0, batch_size=3, device=torch.device("cpu"))
    assert syncs == ["tolist"]  # four batches, one sync at the end


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_to_cuda_are_pinned_and_non_blocking():
    host = torch.arange(8)
    on_gpu = to_device(host, torch.device("cuda"))
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), host)
    with torch.cuda.device(0):
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(50_000_000)  # keep the GPU busy: a pageable copy would wait for it
        to_device(torch.arange(1 << 20), torch.device("cuda"))
        assert not stream.query()  # returned while the GPU was still busy
        torch.cuda.synchronize()
