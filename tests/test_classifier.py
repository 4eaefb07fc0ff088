"""The classification head and its compiled fine-tune / eval steps (model/classifier.py)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from cram import model
from cram.model.classifier import (
    classify,
    finetune_loss,
    init_head_params,
    make_classify_eval_step,
    make_finetune_step,
    pool,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = model.ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=32)
OPT = model.AdamW(eps=1e-6, weight_decay=0.0, clip_norm=0.0)


def params_with_head(num_outputs: int = 3) -> dict:
    return {**model.init(CFG, 0), **init_head_params(CFG, num_outputs, 1)}


def toy_batch(rows: int = 16, length: int = 12, seed: int = 0) -> dict:
    """Class = token at position 1 mod 3: learnable in a few dozen steps."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 64, (rows, length), generator=gen)
    ids[:, 0] = 2
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(rows, length, dtype=torch.bool),
        "labels": ids[:, 1] % 3,
        "weights": torch.ones(rows),
    }


def test_head_init_is_seeded_and_shaped():
    a, b = init_head_params(CFG, 4, seed=7), init_head_params(CFG, 4, seed=7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["classifier.out.weight"].shape == (4, CFG.hidden)
    assert not torch.equal(a["classifier.dense.weight"], init_head_params(CFG, 4, seed=8)["classifier.dense.weight"])


def test_mean_pooling_averages_real_tokens_only():
    hidden = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    pooled = pool(hidden, mask, "mean")
    assert torch.equal(pooled[0], (hidden[0, 0] + hidden[0, 1]) / 2)
    assert torch.equal(pooled[1], hidden[1].mean(0))
    assert torch.equal(pool(hidden, mask, "first"), hidden[:, 0])


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_padding_to_a_longer_bucket_leaves_logits_unchanged(pooling):
    params = params_with_head()
    short = toy_batch(rows=4, length=7)
    padded_ids = torch.zeros(4, 16, dtype=torch.long)
    padded_ids[:, :7] = short["input_ids"]
    padded_mask = torch.zeros(4, 16, dtype=torch.bool)
    padded_mask[:, :7] = True
    expected = classify(params, CFG, short["input_ids"], short["attention_mask"], pooling)
    got = classify(params, CFG, padded_ids, padded_mask, pooling)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_loss_ignores_weightless_rows_and_regresses_floats():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]])
    labels = torch.tensor([0, 1, 1])
    weights = torch.tensor([1.0, 1.0, 0.0])
    torch.testing.assert_close(finetune_loss(logits, labels, weights), F.cross_entropy(logits[:2], labels[:2]))
    targets = torch.tensor([1.0, 3.0, 100.0])
    # ((2 - 1)^2 + (0 - 3)^2) / 2 over the two weighted rows
    torch.testing.assert_close(finetune_loss(logits[:, :1], targets, weights), torch.tensor(5.0))


def test_compiled_steps_are_one_graph_each_and_match_eager():
    params = params_with_head()
    eager = make_finetune_step(CFG, OPT, model.EAGER)
    compiled = make_finetune_step(CFG, OPT, model.Compilation(backend="aot_eager"))
    predict = make_classify_eval_step(CFG, model.Compilation(backend="aot_eager"))
    before = counters["stats"]["unique_graphs"]
    expected = got = (params, model.optimizer_init(model.AdamW(), params))
    # New params, batches and learning rates are inputs, not constants: none of them recompiles.
    for seed, lr in enumerate([1e-3, 5e-4, 2e-4]):
        batch = toy_batch(seed=seed)
        *expected, expected_metrics = eager(*expected, batch, torch.tensor(lr))
        *got, metrics = compiled(*got, batch, torch.tensor(lr))
    logits = predict(got[0], batch)
    predict(got[0], toy_batch(seed=5))
    assert counters["stats"]["unique_graphs"] - before == 2
    torch.testing.assert_close(metrics, expected_metrics)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(logits, classify(expected[0], CFG, batch["input_ids"], batch["attention_mask"]))


def test_the_dropout_rate_is_an_input_of_one_graph():
    """The canary's rate 0 and the fine-tune's 0.1 share one compiled graph; at 0 it computes what eager
    does, at 0.1 it draws fresh masks every step."""
    params = params_with_head()
    eager = make_finetune_step(CFG, OPT, model.EAGER)
    compiled = make_finetune_step(CFG, OPT, model.Compilation(backend="aot_eager"))
    state, lr = (params, model.optimizer_init(model.AdamW(), params)), torch.tensor(1e-3)
    before = counters["stats"]["unique_graphs"]
    at_zero = {**toy_batch(), "dropout": torch.tensor(0.0)}
    torch.testing.assert_close(compiled(*state, at_zero, lr)[2], eager(*state, at_zero, lr)[2])
    dropped = {**toy_batch(), "dropout": torch.tensor(0.1)}
    losses = {float(compiled(*state, dropped, lr)[2]["loss"]) for _ in range(3)}
    assert counters["stats"]["unique_graphs"] - before == 1
    assert len(losses) == 3 and float(compiled(*state, at_zero, lr)[2]["loss"]) not in losses


@pytest.mark.parametrize("kind", ["adamw", "stable_adamw"])
def test_a_donated_eager_step_is_the_pure_step_written_into_its_inputs(kind):
    """`donate=True` (the fine-tune loop's own copies) writes AdamW's new params and moments into the
    tensors given, with decay on the matrices alone and clipping as the pure update has them."""
    opt = model.optimizer_config(kind, eps=1e-6, weight_decay=0.1, clip_norm=0.05)
    step = make_finetune_step(CFG, opt, model.EAGER)
    pure = (params_with_head(), model.optimizer_init(model.AdamW(), params_with_head()))
    owned = ({k: v.clone() for k, v in pure[0].items()}, model.optimizer_init(model.AdamW(), pure[0]))
    given = owned[0]["layers.0.attn.qkv.weight"]
    for seed, lr in enumerate([1e-2, 5e-3, 2e-3]):
        batch = toy_batch(seed=seed)
        *pure, expected = step(*pure, batch, torch.tensor(lr))
        *owned, metrics = step(*owned, batch, torch.tensor(lr), donate=True)
    assert expected["grad_norm"] > opt.clip_norm  # the clip applied
    torch.testing.assert_close(metrics, expected)
    torch.testing.assert_close(owned, pure)
    assert (owned[0]["layers.0.attn.qkv.weight"] is given) == (kind == "adamw")  # stable_adamw: the pure update


def test_finetune_step_learns_a_toy_task():
    params, batch = params_with_head(), toy_batch(rows=32)
    opt_state = model.optimizer_init(model.AdamW(), params)
    step = make_finetune_step(CFG, OPT, model.EAGER)
    first = None
    for _ in range(60):
        params, opt_state, metrics = step(params, opt_state, batch, torch.tensor(2e-3))
        first = first if first is not None else float(metrics["loss"])
    assert float(metrics["loss"]) < first / 2


def test_unknown_pooling_is_rejected():
    with pytest.raises(ValueError, match="pooling"):
        make_finetune_step(CFG, OPT, model.EAGER, pooling="max")


def test_finetune_dropout_is_random_inside_one_graph_and_prediction_has_none():
    dropped = dataclasses.replace(CFG, dropout=0.1)
    params = {**model.init(CFG, 0), **init_head_params(CFG, 3, 1, width=48)}
    assert params["classifier.dense.weight"].shape == (48, CFG.hidden)  # cramming's head is wider (1024)
    step = make_finetune_step(dropped, OPT, model.Compilation(backend="aot_eager"))
    predict = make_classify_eval_step(CFG, model.Compilation(backend="aot_eager"))
    state, batch, lr = (params, model.optimizer_init(model.AdamW(), params)), toy_batch(), torch.tensor(0.0)
    before = counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    losses = [step(*state, batch, lr)[2]["loss"] for _ in range(3)]  # lr 0: the params stay put
    torch.manual_seed(0)
    again = step(*state, batch, lr)[2]["loss"]
    logits = [predict(params, batch) for _ in range(2)]
    assert counters["stats"]["unique_graphs"] - before == 2
    assert len({float(x) for x in losses}) == 3  # fresh dropout masks every step, same graph
    assert float(again) == float(losses[0])  # ... drawn from torch's seeded generator
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    no_dropout = make_finetune_step(CFG, OPT, model.EAGER)
    assert float(no_dropout(*state, batch, lr)[2]["loss"]) == float(no_dropout(*state, batch, lr)[2]["loss"])


def test_pretraining_has_no_dropout_and_evaluate_defaults_are_crammings():
    from cram.stages.evaluate import Config

    assert model.ModelConfig().dropout == 0.0 and all(p.dropout == 0.0 for p in model.PRESETS.values())
    assert (Config().dropout, Config().head_width) == (0.1, 1024)
