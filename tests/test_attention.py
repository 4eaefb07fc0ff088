"""The written-out attention and SDPA compute the same, on a CPU (and on CUDA where there is one), so
`[run] attention = "written"` is a safe way round an SDPA kernel that fails on a GPU; and the steps refuse
params that require grad."""

from __future__ import annotations

import pytest
import torch

from cram import model
from cram.model import bert

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CFG = model.ModelConfig(vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_seq_len=12, position="rope")


def qkv(seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, 12, 8, generator=gen).to(device) for _ in range(3))


def documents() -> torch.Tensor:
    """[2, 12]: three documents in the first row, one in the second."""
    return torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])


def document_mask() -> torch.Tensor:
    ids = documents()
    return (ids[:, :, None] == ids[:, None, :])[:, None]  # [B, 1, S, S], True where a key may be read


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", [None, "padding", "documents"])
def test_written_out_attention_equals_sdpa(mask, device):
    q, k, v = qkv(device=device)
    masks = {None: None, "padding": torch.arange(12)[None, None, None, :] < torch.tensor([12, 7])[:, None, None, None]}
    masks["documents"] = document_mask()
    chosen = None if masks[mask] is None else masks[mask].to(device)
    written = bert._attend(q, k, v, chosen, 0.0, "written")
    sdpa = bert._attend(q, k, v, chosen, 0.0, "sdpa")
    torch.testing.assert_close(written, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["written", "sdpa"])
def test_a_query_that_reads_only_itself_gets_its_own_value(attention):
    q, k, v = qkv(1)
    alone = torch.eye(12, dtype=torch.bool)[None, None]  # by hand: softmax over one key is 1
    torch.testing.assert_close(bert._attend(q, k, v, alone, 0.0, attention), v)


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 64, (2, 12), generator=gen)
    positions = torch.tensor([1, 4, 6, 10, 13, 15, 19, 22])
    out = {"input_ids": ids, "mlm_positions": positions, "mlm_labels": ids.flatten()[positions]}
    return {k: v.to(device) for k, v in {**out, "document_ids": documents()}.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_under_torch_func_are_the_same_with_either_attention(device):
    params = {k: v.to(device) for k, v in model.init(CFG, seed=0).items()}
    grads = {}
    for attention in ("written", "sdpa"):
        loss = lambda p, a=attention: model.mlm_loss(p, CFG, batch(device), a)[0]  # noqa: E731
        grads[attention] = torch.func.grad(loss)(params)
    for name in params:
        torch.testing.assert_close(grads["written"][name], grads["sdpa"][name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_step_with_sdpa_trains_as_the_written_out_one(device):
    opt = model.AdamW()
    lr = torch.tensor(1e-3, device=device)
    params = {k: v.to(device) for k, v in model.init(CFG, seed=0).items()}
    backend = "aot_eager" if device == "cpu" else "inductor"  # on CUDA: what pretrain compiles
    out = {}
    for attention, compile in (("written", False), ("sdpa", True)):
        step = model.make_train_step(CFG, opt, model.Compilation(compile=compile, backend=backend, attention=attention))
        p, s = params, model.optimizer_init(model.AdamW(), params)
        for _ in range(2):
            p, s, metrics = step(p, s, batch(device), lr)
        out[attention] = (p, metrics["loss"])
    torch.testing.assert_close(out["sdpa"][1], out["written"][1], rtol=1e-5, atol=1e-5)
    for name in params:
        torch.testing.assert_close(out["sdpa"][0][name], out["written"][0][name], rtol=1e-4, atol=1e-5)


def test_auto_is_sdpa_on_a_gpu_and_on_a_cpu_written_out_where_a_gradient_is_taken():
    assert model.attends_with("auto", torch.device("cpu")) == "written"
    assert model.attends_with("auto", torch.device("cpu"), grad=False) == "sdpa"
    assert model.attends_with("auto", torch.device("cuda", 0)) == "sdpa"
    assert model.attends_with("written", torch.device("cpu"), grad=False) == "written"
    assert model.attends_with("written", torch.device("cuda", 0)) == "written"
    with pytest.raises(ValueError, match="allowed auto, sdpa, written"):
        model.attends_with("flash", torch.device("cpu"))


def test_auto_attends_with_sdpa_where_no_gradient_is_taken_and_written_out_where_one_is():
    q, k, v = qkv(3)
    mask = torch.arange(12)[None, None, None, :] < torch.tensor([12, 7])[:, None, None, None]
    with torch.no_grad():
        assert torch.equal(bert._attend(q, k, v, mask, 0.0, "auto"), bert._attend(q, k, v, mask, 0.0, "sdpa"))
    out = torch.func.grad(lambda q: bert._attend(q, k, v, mask, 0.0, "auto").sum())(q)
    assert torch.equal(out, torch.func.grad(lambda q: bert._attend(q, k, v, mask, 0.0, "written").sum())(q))


def test_steps_refuse_params_that_require_grad():
    params = {k: v.requires_grad_() if k == "embed.tokens.weight" else v for k, v in model.init(CFG, 0).items()}
    step = model.make_train_step(CFG, model.AdamW(), model.EAGER)
    with pytest.raises(ValueError, match=r"params\['embed.tokens.weight'\] requires grad"):
        step(params, model.optimizer_init(model.AdamW(), params), batch(), torch.tensor(1e-3))
    accumulate = model.make_accumulate_step(CFG, model.EAGER)
    with pytest.raises(ValueError, match="requires grad"):
        accumulate(params, {k: torch.zeros_like(v) for k, v in params.items()}, batch())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach()).norm() / b.detach().norm())


@pytest.mark.parametrize("mask", [None, "documents"])
def test_under_bf16_autocast_the_written_attention_is_an_fp32_softmax_of_the_bf16_operands(mask):
    """The scores stay in bf16 (no fp32 copy of [B, heads, S, S]); the softmax kernel accumulates in fp32 on every
    CPU kind, so output and gradients are the fp32 computation's from the same bf16 operands, to a few of bf16's
    roundings (each 2**-8 relative; measured 3-6e-3 on an AVX512-BF16 CPU; the bound is four of them)."""
    chosen = None if mask is None else document_mask()
    q, k, v = (t.requires_grad_() for t in qkv(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bert._attend(q, k, v, chosen, 0.0, "written")
    leaves = [t.detach().bfloat16().float().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] * 8**-0.5 @ leaves[1].transpose(-1, -2)
    if chosen is not None:
        scores = scores.masked_fill(~chosen, float("-inf"))
    reference = scores.softmax(dim=-1) @ leaves[2]
    assert out.dtype == torch.bfloat16 and relative(out, reference) < 2**-6
    upstream = torch.randn(reference.shape, generator=torch.Generator().manual_seed(4))
    ours = torch.autograd.grad(out, (q, k, v), upstream.bfloat16())
    theirs = torch.autograd.grad(reference, leaves, upstream)
    assert all(relative(a, b) < 2**-6 for a, b in zip(ours, theirs))


@pytest.mark.parametrize("compiled", [False, True])
def test_sdpa_with_dropout_under_cpu_autocast_has_gradients_under_torch_func(compiled):
    """SDPA's own dropout fails there in the backward (torch 2.13); such a step attends with the written-out
    product, and one compiled graph takes it as eagerly."""
    cfg = model.ModelConfig(vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_seq_len=12)
    ids, mask = batch()["input_ids"], torch.ones(2, 12, dtype=torch.bool)

    def loss(params):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return bert.encode(params, cfg, ids, mask, attention="sdpa", dropout=0.1).float().pow(2).mean()

    grad = torch.func.grad(loss)
    if compiled:
        grad = torch.compile(grad, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    grads = grad(model.init(cfg, seed=0))
    assert all(torch.isfinite(g).all() for g in grads.values())
