"""The memory estimate of a training step (`model/memory.py`) against what a step really allocates."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cram import model
from cram.model import AdamW, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dataclasses.replace(model.PRESETS["tiny"], vocab_size=4096, max_seq_len=128)


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes held by tensor storages made inside the block: each storage counts from
    the op that makes it until it is freed, so the peak is what an allocator would have to hold."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, weakref.finalize] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._hold(value.untyped_storage())
        return out

    def _hold(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self.storages:
            size = storage.nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            self.storages[key] = weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.storages.pop(key, None)


def measured_step_peak(cfg: ModelConfig, microbatch: int, per_sequence: int, autocast: torch.dtype | None) -> int:
    """Peak bytes of making the params and AdamW state and taking one eager training step."""
    step = model.make_train_step(cfg, AdamW(), model.Compilation(compile=False, autocast=autocast))
    gen = torch.Generator().manual_seed(0)
    S = cfg.max_seq_len
    with PeakBytes() as peak:
        params = model.init(cfg, seed=0)
        opt_state = model.optimizer_init(model.AdamW(), params)
        ids = torch.randint(10, cfg.vocab_size, (microbatch, S), generator=gen)
        chosen = torch.rand(microbatch, S, generator=gen).argsort(dim=1)[:, :per_sequence]
        positions = (chosen + S * torch.arange(microbatch)[:, None]).flatten()
        batch = {"input_ids": ids, "mlm_positions": positions, "mlm_labels": ids.flatten()[positions]}
        step(params, opt_state, batch, torch.tensor(1e-3))
    return peak.peak


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"norm_bias": True},
        {"position": "learned"},
        {"position": "sinusoidal", "first_attn_norm": True},
        {"glu": False},
        {"head_transform": False, "embedding_norm": False},
        {"local_attention": 8, "global_every": 3, "local_rope_theta": 1e4, "decoder_bias": True},
        {"linear_bias": True},
        {"position": "learned", "first_attn_norm": True, "post_norm": True, "linear_bias": True, "norm_bias": True},
        {"position": "learned", "position_offset": 2, "token_types": 2, "decoder_bias": True, "glu": False},
    ],
)
def test_parameter_count_is_what_init_makes(changes):
    cfg = dataclasses.replace(model.PRESETS["tiny"], **changes)
    assert model.parameter_count(cfg) == model.num_params(model.init(cfg, seed=0))


@pytest.mark.parametrize("layers, microbatch, autocast", [(1, 16, None), (2, 32, None), (2, 32, torch.bfloat16)])
def test_the_estimate_is_within_2x_of_a_measured_eager_step(layers, microbatch, autocast):
    cfg = dataclasses.replace(TINY, layers=layers)
    per_sequence = 32  # pretraining's 25% of 128
    measured = measured_step_peak(cfg, microbatch, per_sequence, autocast)
    estimate = model.training_memory(cfg, microbatch, microbatch * per_sequence, autocast is not None)
    assert measured / 2 <= estimate.total <= 2 * measured, (estimate, measured)


def test_the_estimate_grows_with_each_knob():
    base = model.training_memory(TINY, 32, 32 * 32, autocast=False)
    for cfg, microbatch in [
        (dataclasses.replace(TINY, hidden=256), 32),
        (dataclasses.replace(TINY, layers=4), 32),
        (dataclasses.replace(TINY, intermediate=1024), 32),
        (TINY, 64),
    ]:
        assert model.training_memory(cfg, microbatch, microbatch * 32, autocast=False).total > base.total
    assert model.training_memory(TINY, 32, 32 * 32, autocast=True).total < base.total
