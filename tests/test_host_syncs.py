"""Host syncs off the hot path: the torchrun clock is agreed every N steps, the held-out MLM sums stay on
the device, host-to-device copies (the prefetched microbatches' too) are pinned and non-blocking on CUDA."""

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
    step = model.make_eval_step(cfg, model.EAGER)
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


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# A sleep kernel of this many GPU cycles (a quarter to half a second) outlasts any copy below many times
# over: a copy that waits for the GPU returns only after the stream has drained.
SLEEP_CYCLES = 500_000_000


@cuda
def test_copies_to_cuda_are_pinned_and_non_blocking():
    device = torch.device("cuda", 0)
    host = torch.arange(1 << 20)
    # Warm-up: the first copy of a size allocates a pinned block (an implicit device synchronisation) and
    # loads the kernels; later copies reuse the block, as the training loop's do.
    assert torch.equal(to_device(host, device).cpu(), host)
    torch.cuda._sleep(1)
    torch.cuda.synchronize(device)
    stream = torch.cuda.current_stream(device)
    torch.cuda._sleep(SLEEP_CYCLES)
    on_gpu = to_device(host, device)
    assert not stream.query()  # returned while the GPU was still busy
    torch.cuda.synchronize(device)
    assert torch.equal(on_gpu.cpu(), host)


@cuda
def test_a_prefetched_microbatch_reaches_the_gpu_without_a_host_sync():
    from cram.stages.pretraining.batches import Feed, Prefetcher
    from cram.stages.pretraining.loop import Steps
    from cram.stages.shared.blocks import Boundary

    device = torch.device("cuda", 0)
    blocks = np.random.default_rng(0).integers(5, 64, size=(64, 16)).astype(np.uint16)
    steps = Steps(None, None, None, torch.Generator(device=device), device, None, Boundary(token=1, starts=True))
    stream = torch.cuda.current_stream(device)
    with Prefetcher(blocks, Feed(0, depth=2, pin=True), start=0, microbatch=8) as data:
        steps.batch(data.next(), spec()), steps.scalar(1e-3)  # warm-up: pinned blocks, kernels loaded
        torch.cuda._sleep(1)
        torch.cuda.synchronize(device)
        wait_until_full(data)  # the thread pins nothing more until one is taken
        torch.cuda._sleep(SLEEP_CYCLES)
        batch, lr = steps.batch(data.next(), spec()), steps.scalar(1e-3)  # the training loop's hot path
        assert not stream.query()  # pinned, copied, masked and document-counted without waiting for the GPU
        torch.cuda.synchronize(device)
    assert batch["input_ids"].is_cuda and batch["document_ids"].is_cuda and float(lr) == pytest.approx(1e-3)


def wait_until_full(data, limit_s: float = 30.0) -> None:
    import time

    end = time.monotonic() + limit_s
    while not data._queue.full():
        assert time.monotonic() < end, "the prefetch thread never filled its queue"
        time.sleep(0.01)
