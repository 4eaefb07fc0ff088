"""The fine-tuner's eager fast path (stages/finetuning/finetune.py, model/classifier.py): eager batches are
padded to their longest row (compiled ones to a bucket), and the loop's steps overwrite only its own copy
of the params, so every seed starts from the same pretrained ones."""

import numpy as np
import pytest
import torch

from cram import model
from cram.stages.evaluate import Config
from cram.stages.finetuning.finetune import Tuner
from cram.stages.shared.precision import FP32
from cram.stages.tasks.config import TaskSettings

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = model.ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=32)
SPECIAL = {"pad": 0, "cls": 1, "sep": 2, "mask": 3, "unk": 4}


def tuner(compile: bool) -> Tuner:
    config = Config(tasks=[], compile=compile, backend="aot_eager", buckets=(16, 32), max_length=32, batch_size=4)
    config = config.linked({})  # pooling and head "auto": from scratch
    return Tuner.make(config.tuning(), CFG, model.init(CFG, 0), SPECIAL, torch.device("cpu"), FP32)


def split(rows: int = 12) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    gen = np.random.default_rng(0)
    texts = [np.asarray([1, *gen.integers(5, 64, size=int(gen.integers(3, 10))), 2]) for _ in range(rows)]
    return texts, np.array([len(t) for t in texts]), np.arange(rows) % 3


def test_eager_batches_are_padded_to_their_longest_row_and_compiled_ones_to_a_bucket():
    rows, lengths, labels = split()
    index = np.arange(3)
    longest = int(lengths[index].max())
    assert tuner(compile=False).batch(rows, lengths, labels, index, 4)["input_ids"].shape == (4, longest)
    assert tuner(compile=True).batch(rows, lengths, labels, index, 4)["input_ids"].shape == (4, 16)


def test_an_eager_fine_tune_leaves_the_pretrained_params_as_they_were():
    eager = tuner(compile=False)
    before = {k: v.clone() for k, v in eager.params.items()}
    first, _ = eager.train(3, split(), TaskSettings(epochs=1, seeds=1, lr=1e-2, max_length=32), seed=0)
    torch.testing.assert_close(eager.params, before, rtol=0, atol=0)
    again, _ = eager.train(3, split(), TaskSettings(epochs=1, seeds=1, lr=1e-2, max_length=32), seed=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not torch.equal(first["layers.0.attn.qkv.weight"], before["layers.0.attn.qkv.weight"])
