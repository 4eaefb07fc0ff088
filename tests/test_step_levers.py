"""The step's speed settings (`Compilation`'s foreach update, lean logits, bf16 Newton-Schulz): each computes
what the default computes, eagerly and compiled, in one graph that never recompiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cram import model
from cram.model import AdamW, ModelConfig, Muon, muon, optimizer_config
from cram.model.bert import cross_entropy_lean
from cram.model.optim import global_norm, optimizer_update

TINIEST = ModelConfig(vocab_size=256, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=16)
LR = torch.tensor(1e-3)


def batch_of(cfg: ModelConfig, batch: int, seed: int, unlabelled: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens and a quarter masked; the first `unlabelled` masked rows labelled -100."""
    gen = torch.Generator().manual_seed(seed)
    S, per_seq = cfg.max_seq_len, cfg.max_seq_len // 4
    chosen = torch.rand(batch, S, generator=gen).argsort(dim=1)[:, :per_seq]
    labels = torch.randint(1, cfg.vocab_size, (batch * per_seq,), generator=gen)
    labels[:unlabelled] = -100
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, S), generator=gen),
        "mlm_positions": (chosen + S * torch.arange(batch)[:, None]).flatten(),
        "mlm_labels": labels,
    }


def random_grads(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}


@pytest.mark.parametrize("kind", ["adamw", "muon", "stable_adamw"])
def test_the_foreach_update_is_the_per_tensor_update_bit_for_bit_on_a_cpu(kind):
    # The same operations in the same order; a CPU runs each list op tensor by tensor, so they agree exactly
    # (on CUDA the multi-tensor kernels may round differently: the compiled comparison below has a tolerance).
    opt = optimizer_config(kind, clip_norm=0.5 if kind != "stable_adamw" else 0.0)
    params = model.init(TINIEST, seed=0)
    runs = {}
    for foreach in (False, True):
        p, state = dict(params), model.optimizer_init(model.AdamW(), params)
        for i in range(3):
            p, state, norm = optimizer_update(opt, p, state, random_grads(params, i), LR, foreach=foreach)
        runs[foreach] = p, state, norm
    (p0, s0, n0), (p1, s1, n1) = runs[False], runs[True]
    assert list(p1) == list(p0) and list(s1) == list(s0)  # the same keys in the same order: no recompile
    assert all(torch.equal(p1[k], p0[k]) for k in p0) and all(torch.equal(s1[k], s0[k]) for k in s0)
    assert torch.equal(n1, n0)


def test_the_fused_norm_is_the_norm_of_every_tensor_together():
    grads = random_grads(model.init(TINIEST, seed=0), seed=1)
    flat = torch.cat([g.flatten() for g in grads.values()]).double().norm()
    assert global_norm(grads, foreach=True).item() == pytest.approx(flat.item(), rel=1e-6)
    assert torch.equal(global_norm(grads, foreach=True), global_norm(grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_loss_is_cross_entropy_over_labelled_rows_and_so_is_its_gradient(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(12, 50, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, 50, (12,), generator=gen)
    labels[:3] = -100
    lean, lean_grad = torch.func.grad_and_value(lambda x: cross_entropy_lean(x, labels))(logits)[::-1]
    ref, ref_grad = torch.func.grad_and_value(lambda x: F.cross_entropy(x.float(), labels, ignore_index=-100))(logits)[
        ::-1
    ]
    assert lean.dtype == ref.dtype == torch.float32
    # Both read the same logits and accumulate in fp32, so they differ by fp32 rounding (logsumexp against
    # log-softmax); the gradients are the same fp32 softmax less the label, cast once to the logits' dtype: in
    # bf16 within one rounding of it (2^-8 of the largest entry).
    assert lean.item() == pytest.approx(ref.item(), rel=1e-6)
    assert lean_grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8
    assert (lean_grad.float() - ref_grad.float()).abs().max() <= tolerance * ref_grad.float().abs().max()
    assert torch.all(lean_grad[:3] == 0)  # unlabelled rows get no gradient


LEVERS = dict(foreach_update=True, fp32_logits=False, bf16_newton_schulz=True)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_every_setting_on_compiled_is_one_graph_and_matches_the_default_eager_step(kind):
    opt = optimizer_config(kind)
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    runs = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for how in (model.EAGER, model.Compilation(backend="aot_eager", **LEVERS)):
            params, state = (
                model.init(TINIEST, seed=0),
                model.optimizer_init(model.AdamW(), model.init(TINIEST, seed=0)),
            )
            step = model.make_train_step(TINIEST, opt, how)
            losses = []
            for i in range(4):
                params, state, metrics = step(params, state, batch_of(TINIEST, 4, seed=i, unlabelled=i), LR)
                losses.append(metrics["loss"])
            runs[how.compile] = torch.stack(losses), params, state
    assert counters["unique_graphs"] - before == 1
    (losses, params, state), (c_losses, c_params, c_state) = runs[False], runs[True]
    assert list(c_state) == list(state)
    # fp32 on a CPU (Newton-Schulz stays fp32 off CUDA): the graph reorders nothing it would round differently
    # by more than fp32's few ulps over four steps.
    assert torch.allclose(c_losses, losses, rtol=1e-5, atol=0)
    for name, p in params.items():
        assert torch.allclose(c_params[name], p, rtol=0, atol=1e-6), name


def test_every_setting_on_under_inductor_matches_the_default_eager_step():
    # fp32: inductor's bf16 CPU code is wrong on some CPUs whatever the settings (docs/compiling.md)
    runs = {}
    for how in (model.EAGER, model.Compilation(**LEVERS)):
        params, state = model.init(TINIEST, seed=0), model.optimizer_init(model.AdamW(), model.init(TINIEST, seed=0))
        step = model.make_train_step(TINIEST, Muon(), how)
        for i in range(3):
            params, state, metrics = step(params, state, batch_of(TINIEST, 4, seed=i), LR)
        runs[how.compile] = metrics["loss"], params
    (loss, params), (c_loss, c_params) = runs[False], runs[True]
    assert c_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for name, p in params.items():  # as tests/test_step.py's inductor comparison of the default step
        assert torch.allclose(c_params[name], p, rtol=0, atol=1e-4), name


def test_bf16_newton_schulz_is_ignored_off_cuda_and_close_to_fp32_where_it_runs():
    params = model.init(TINIEST, seed=0)
    grads = random_grads(params, seed=3)
    opt = Muon()
    plain = optimizer_update(opt, params, model.optimizer_init(model.AdamW(), params), grads, LR)
    bf16 = optimizer_update(
        opt, params, model.optimizer_init(model.AdamW(), params), grads, LR, bf16_newton_schulz=True
    )
    assert all(torch.equal(bf16[0][k], plain[0][k]) for k in params)  # a CPU: fp32 whatever the setting
    from torch.optim._muon import _zeropower_via_newtonschulz as reference

    update = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(0))
    fp32, in_bf16 = muon.orthogonalise(update), muon.orthogonalise(update, torch.bfloat16)
    theirs = torch.stack([reference(m, muon.NS_COEFFICIENTS, muon.NS_STEPS, muon.NS_EPS).float() for m in update])
    assert in_bf16.dtype == torch.float32

    def off(x: torch.Tensor) -> float:
        return ((x - fp32).norm() / fp32.norm()).item()

    # bf16 rounds each of the 15 products (a few % in all): as far from fp32 as torch.optim.Muon's bf16 is.
    assert 0 < off(in_bf16) <= 1.5 * off(theirs)


def test_the_autocast_residual_stream_is_bf16_and_trains_as_the_default_to_bf16_rounding():
    import dataclasses

    params = model.init(TINIEST, seed=0)
    ids = batch_of(TINIEST, 2, seed=0)["input_ids"]
    post = dataclasses.replace(TINIEST, post_norm=True)  # its output is the residual stream itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.encode(model.init(post, 0), post, ids).dtype == torch.float32
        assert model.encode(model.init(post, 0), post, ids, residual=torch.bfloat16).dtype == torch.bfloat16
    runs = {}
    for name, how in (
        ("default", model.Compilation(compile=False, autocast=torch.bfloat16)),
        ("eager", model.Compilation(compile=False, autocast=torch.bfloat16, autocast_residual=True)),
        ("compiled", model.Compilation(backend="aot_eager", autocast=torch.bfloat16, autocast_residual=True)),
    ):
        p, state = params, model.optimizer_init(model.AdamW(), params)
        step = model.make_train_step(TINIEST, AdamW(), how)
        for i in range(3):
            p, state, metrics = step(p, state, batch_of(TINIEST, 4, seed=i), LR)
        runs[name] = metrics["loss"].item(), p
    assert runs["compiled"][0] == pytest.approx(runs["eager"][0], rel=1e-3)  # the same bf16 ops, traced
    assert runs["eager"][0] == pytest.approx(runs["default"][0], rel=1e-2)  # bf16's rounding of the stream
    assert runs["eager"][0] != runs["default"][0]  # it did round the stream
    fp32 = model.make_train_step(TINIEST, AdamW(), model.Compilation(compile=False, autocast_residual=True))
    plain = model.make_train_step(TINIEST, AdamW(), model.EAGER)
    batch, state = batch_of(TINIEST, 4, seed=0), model.optimizer_init(model.AdamW(), params)
    assert torch.equal(fp32(params, state, batch, LR)[2]["loss"], plain(params, state, batch, LR)[2]["loss"])
