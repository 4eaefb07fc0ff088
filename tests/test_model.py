"""The functional encoder, its loss, AdamW, schedules and FLOP count (eager, no compiling)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from cram import model
from cram.model import AdamW, ModelConfig, Muon, OptimizerConfig, StableAdamW, optimizer_config
from cram.model.hf import to_transformers

# Small enough for float64 finite differences over every parameter.
MICRO = ModelConfig(vocab_size=24, hidden=8, layers=2, heads=2, intermediate=16, max_seq_len=6)
SMALL = dict(vocab_size=100, hidden=32, layers=3, heads=2, intermediate=64)
MODERNBERT = dict(position="rope", head_transform=True, first_attn_norm=False)
LOCAL = dict(MODERNBERT, local_attention=4, global_every=3, local_rope_theta=500.0, decoder_bias=True)
BERT = dict(
    position="learned", glu=False, head_transform=True, post_norm=True, linear_bias=True, norm_bias=True, token_types=2
)


def random_batch(cfg: ModelConfig, batch: int, per_seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    S = cfg.max_seq_len
    chosen = torch.rand(batch, S, generator=gen).argsort(dim=1)[:, :per_seq]
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, S), generator=gen),
        "mlm_positions": (chosen + S * torch.arange(batch)[:, None]).flatten(),
        "mlm_labels": torch.randint(1, cfg.vocab_size, (batch * per_seq,), generator=gen),
    }


def test_parameter_names_shapes_and_count():
    cfg = ModelConfig(vocab_size=4096, hidden=128, layers=2, heads=2, intermediate=512)  # cramming's layout
    params = model.init(cfg, seed=0)
    H, inter = cfg.hidden, cfg.intermediate
    expected = {"embed.tokens.weight": (cfg.vocab_size, H), "embed.positions.scale": (1,), "embed.norm.weight": (H,)}
    for i in range(cfg.layers):
        expected |= {
            f"layers.{i}.attn_norm.weight": (H,),
            f"layers.{i}.attn.qkv.weight": (3 * H, H),
            f"layers.{i}.attn.out.weight": (H, H),
            f"layers.{i}.ffn_norm.weight": (H,),
            f"layers.{i}.ffn.up.weight": (inter, H),
            f"layers.{i}.ffn.down.weight": (H, inter // 2),
        }
    expected["final_norm.weight"] = (H,)
    assert {name: tuple(p.shape) for name, p in params.items()} == expected
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params.values())

    modern = model.init(ModelConfig(**{**SMALL, **MODERNBERT}, glu=False), seed=0)
    assert "layers.0.attn_norm.weight" not in modern and "layers.1.attn_norm.weight" in modern
    assert not any(name.startswith("embed.positions") for name in modern)
    assert modern["head.dense.weight"].shape == (32, 32) and modern["layers.0.ffn.down.weight"].shape == (32, 64)
    assert model.init(ModelConfig(**SMALL, position="learned"), seed=0)["embed.positions.weight"].shape == (128, 32)


def test_presets_use_the_modernbert_layout_and_keep_crammed_bert():
    for name in ("tiny", "small", "base"):
        preset = model.PRESETS[name]
        assert (preset.position, preset.head_transform, preset.first_attn_norm) == ("rope", True, False)
    crammed = model.PRESETS["crammed-base"]
    assert crammed == ModelConfig() and crammed.position == "sinusoidal" and crammed.first_attn_norm
    assert model.PRESETS["base"] == ModelConfig(**MODERNBERT)  # the same dimensions as crammed-BERT
    scaled = model.init(ModelConfig(**SMALL, position_scale=0.03), seed=0)["embed.positions.scale"]
    assert scaled.item() == pytest.approx(0.03) and model.init(ModelConfig(**SMALL), seed=0)[
        "embed.positions.scale"
    ].item() == pytest.approx(32**-0.5)


def test_the_bert_and_local_layouts_add_their_parameters():
    bert = ModelConfig(**SMALL, **BERT, decoder_bias=True, position_offset=2)
    params = model.init(bert, seed=0)
    H, inter = bert.hidden, bert.intermediate
    assert params["embed.positions.weight"].shape == (2 + 128, H) and params["embed.types.weight"].shape == (2, H)
    assert "final_norm.weight" not in params and "layers.0.attn_norm.weight" in params
    assert {name: p.shape[0] for name, p in params.items() if name.startswith("layers.0.") and "bias" in name} == {
        "layers.0.attn_norm.bias": H,
        "layers.0.attn.qkv.bias": 3 * H,
        "layers.0.attn.out.bias": H,
        "layers.0.ffn_norm.bias": H,
        "layers.0.ffn.up.bias": inter,
        "layers.0.ffn.down.bias": H,
    }
    assert params["head.dense.bias"].shape == (H,) and params["head.decoder.bias"].shape == (bert.vocab_size,)
    zero = [name for name in params if name.endswith(".bias") and "norm" not in name]
    assert all(not params[name].any() for name in zero) and len(zero) == 3 * 4 + 2
    assert (
        model.init(ModelConfig(**SMALL, **LOCAL), seed=0).keys()
        == model.init(ModelConfig(**SMALL, **MODERNBERT, decoder_bias=True), seed=0).keys()
    )


@pytest.mark.parametrize(
    "overrides", [{}, MODERNBERT, {"position": "learned", "glu": False}, LOCAL, {**BERT, "decoder_bias": True}]
)
def test_flops_per_token_counts_every_non_embedding_parameter(overrides):
    cfg = ModelConfig(**SMALL, **overrides)
    params = model.init(cfg, seed=0)
    embedding = sum(
        p.numel() for name, p in params.items() if name.startswith(("embed.tokens", "embed.positions", "embed.types"))
    )
    head = sum(p.numel() for name, p in params.items() if name.startswith("head."))
    non_embedding = model.num_params(params) - embedding - head
    decoder = (cfg.hidden * cfg.vocab_size + head) * 0.25
    attention = 12 * cfg.layers * cfg.hidden * cfg.max_seq_len
    assert model.flops_per_token(cfg, 0.25) == pytest.approx(6 * non_embedding + attention + 6 * decoder, abs=6)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # per layer: norms 2·32 + qkv 96·32 + out 32·32 + up 64·32 + down 32·32 = 7,232; encoder 3·7,232
        # + embedding norm 32 + final norm 32 = 21,760. 6·21,760 + 12·3·32·128 (attention) = 278,016, and
        # the tied decoder for the masked quarter: 6·32·100·0.25 = 4,800.
        ({}, 278_016 + 4_800),
        # no first attention norm (21,760 - 32 = 21,728), a head transform (32·32 + norm 32 = 1,056):
        # 6·21,728 + 147,456 = 277,824, decoder 6·(3,200 + 1,056)·0.25 = 6,384.
        (MODERNBERT, 277_824 + 6_384),
    ],
)
def test_flops_per_token_of_a_small_model_by_hand(overrides, expected):
    cfg = ModelConfig(**SMALL, **overrides)
    assert cfg.max_seq_len == 128
    assert model.flops_per_token(cfg, 0.25) == expected


def test_flops_per_token_with_the_encoder_frozen_by_hand():
    # MODERNBERT's small model with the head alone trained: the encoder forward 2·21,728 = 43,456, attention's
    # forward 4·3·32·128 = 49,152; the decoder forward and its backward to its input 4·3,200, the head's
    # transform forward and backward 6·1,056, for the masked quarter: (12,800 + 6,336)·0.25 = 4,784.
    cfg = ModelConfig(**SMALL, **MODERNBERT)
    assert model.flops_per_token(cfg, 0.25, encoder_trained=False) == 43_456 + 49_152 + 4_784


def test_peak_flops_of_a_cpu_is_the_best_of_its_timed_matmuls(monkeypatch):
    from cram.model import flops

    # start and end of each of 1 + 3 matmuls: 1 s (the warm-up), 0.5 s, 0.25 s, 0.4 s
    ticks = iter([0.0, 1.0, 10.0, 10.5, 20.0, 20.25, 30.0, 30.4])
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
    assert flops.measure_matmul_flops(torch.device("cpu"), torch.float32, size=64, repeats=3) == 2 * 64**3 / 0.25


def test_peak_flops_is_the_data_sheet_bf16_figure_of_a_known_gpu(monkeypatch):
    from cram.model import flops

    measured = []
    monkeypatch.setattr(
        flops,
        "measure_matmul_flops",
        lambda device, dtype, size=None: measured.append((device.type, dtype, size)) or 1.0,
    )
    for name, peak in (
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert model.peak_flops("cuda") == peak
    assert measured == []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert model.peak_flops("cuda") == 1.0 and measured == [("cuda", torch.bfloat16, 8192)]
    assert model.peak_flops("cpu") == 1.0 and model.peak_flops("cpu", torch.bfloat16) == 1.0
    assert measured[1:] == [("cpu", torch.float32, None), ("cpu", torch.bfloat16, None)]  # its default size


def test_init_is_deterministic_per_seed():
    a, b, c = (model.init(MICRO, seed) for seed in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.qkv.weight"], c["layers.0.attn.qkv.weight"])


def test_invalid_config_names_the_key():
    with pytest.raises(ValueError, match="model.heads"):
        ModelConfig(hidden=100, heads=12)
    with pytest.raises(ValueError, match="model.position"):
        ModelConfig(position="alibi")


@pytest.mark.parametrize(
    "position, overrides",
    [("sinusoidal", {}), ("learned", {}), ("rope", {}), ("rope", LOCAL), ("learned", {**BERT, "position_offset": 3})],
)
def test_padding_never_changes_real_tokens(position, overrides):
    overrides = {**overrides, "position": position}
    cfg = ModelConfig(vocab_size=50, hidden=16, layers=2, heads=2, intermediate=32, max_seq_len=10, **overrides)
    params = model.init(cfg, seed=0)
    ids = torch.randint(1, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    other = ids.clone()
    other[1, 6:] = torch.randint(1, 50, (4,))
    hidden = model.encode(params, cfg, ids, mask)
    assert torch.allclose(hidden[mask], model.encode(params, cfg, other, mask)[mask], atol=1e-6)
    # Without the mask the padded tokens leak in: the test above is not vacuous.
    assert not torch.allclose(model.encode(params, cfg, ids)[1, :6], model.encode(params, cfg, other)[1, :6])


@pytest.mark.parametrize(
    "overrides, layers",
    [({}, 2), (MODERNBERT, 2), (LOCAL, 3), (LOCAL, 2), ({**BERT, "position_offset": 2}, 2), (MODERNBERT, 1)],
)
def test_first_only_is_the_first_token_of_the_whole_encoding(overrides, layers):
    # LOCAL at 2 layers ends on a local layer (a mask per query), at 3 on a global one.
    cfg = ModelConfig(vocab_size=50, hidden=16, layers=layers, heads=2, intermediate=32, max_seq_len=10, **overrides)
    params = {k: v * 10 if v.ndim == 2 else v for k, v in model.init(cfg, seed=0).items()}
    ids = torch.randint(1, 50, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 4:] = False
    types = (torch.arange(10) >= 5).long().expand(3, 10) if cfg.token_types else None
    whole = model.encode(params, cfg, ids, mask, token_type_ids=types)
    first = model.encode(params, cfg, ids, mask, token_type_ids=types, first_only=True)
    assert first.shape == (3, 1, 16)
    torch.testing.assert_close(first[:, 0], whole[:, 0], atol=1e-5, rtol=1e-5)
    # The first token reads the others: a change after it changes its state.
    other = ids.clone()
    other[:, 3] = (other[:, 3] + 1) % 50
    assert not torch.allclose(model.encode(params, cfg, other, mask, token_type_ids=types, first_only=True), first)


@pytest.mark.parametrize("overrides", [MODERNBERT, {**LOCAL, "local_attention": 6}])
def test_document_ids_encode_each_packed_document_as_if_alone(overrides):
    # With rope a token sees only relative positions, so a document packed after another encodes as it
    # does alone, once document_ids keep the two apart; padding after them changes nothing either.
    cfg = ModelConfig(vocab_size=50, hidden=16, layers=3, heads=2, intermediate=32, max_seq_len=16, **overrides)
    params = {k: v * 10 if v.ndim == 2 else v for k, v in model.init(cfg, seed=0).items()}
    ids = torch.randint(1, 50, (1, 16))
    documents = torch.tensor([[0] * 7 + [1] * 6 + [2] * 3])
    mask = documents < 2
    packed = model.encode(params, cfg, ids, mask, document_ids=documents)[0]
    alone = [model.encode(params, cfg, ids[:, a:b])[0] for a, b in ((0, 7), (7, 13))]
    assert torch.allclose(packed[:13], torch.cat(alone), atol=1e-5)
    assert torch.isfinite(packed).all()  # padded queries see no real key of their document: not NaN
    assert not torch.allclose(model.encode(params, cfg, ids, mask)[0, 7:13], alone[1], atol=1e-3)
    batch = random_batch(cfg, batch=1, per_seq=4)
    loss, _ = model.mlm_loss(
        params, cfg, {**batch, "input_ids": ids, "attention_mask": mask, "document_ids": documents}
    )
    rows = model.mlm_logits(params, cfg, packed)[batch["mlm_positions"]]
    assert loss.item() == pytest.approx(F.cross_entropy(rows, batch["mlm_labels"]).item(), rel=1e-5)


def test_local_layers_read_keys_within_half_the_window_and_padding_never():
    cfg = ModelConfig(vocab_size=50, hidden=16, layers=4, heads=2, intermediate=32, max_seq_len=8, **LOCAL)
    assert [cfg.is_local(i) for i in range(4)] == [False, True, True, False]  # global when i % 3 == 0
    padding = torch.tensor([[True] * 8, [True] * 3 + [False] * 5])
    full, local = model.bert._masks(cfg, 8, padding, None, torch.device("cpu"))
    assert torch.equal(full, padding[:, None, None, :])
    i = torch.arange(8)
    band = (i[:, None] - i[None, :]).abs() <= 2  # local_attention=4: two each side
    assert torch.equal(local[0, 0], band)
    # A padded query reads only itself when no real key is in its window (a softmax over nothing is NaN).
    assert torch.equal(local[1, 0], (band & padding[1]) | torch.eye(8, dtype=torch.bool))
    assert model.bert._masks(dataclasses.replace(cfg, local_attention=0), 8, None, None, torch.device("cpu")) == (
        None,
        None,
    )


def test_sparse_loss_equals_dense_loss_at_the_masked_positions():
    cfg = model.PRESETS["tiny"]
    params = model.init(cfg, seed=0)
    batch = random_batch(cfg, batch=3, per_seq=32)
    loss, aux = model.mlm_loss(params, cfg, batch)
    logits = model.mlm_logits(params, cfg, model.encode(params, cfg, batch["input_ids"])).flatten(0, 1)
    dense_labels = torch.full((logits.shape[0],), -100)
    dense_labels[batch["mlm_positions"]] = batch["mlm_labels"]
    assert loss.item() == pytest.approx(F.cross_entropy(logits, dense_labels).item(), rel=1e-5)
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), rel=0.05)  # untrained: near uniform
    hits = logits.argmax(-1)[batch["mlm_positions"]] == batch["mlm_labels"]
    assert aux["accuracy"].item() == pytest.approx(hits.float().mean().item())


@pytest.mark.parametrize("overrides", [{}, MODERNBERT, LOCAL, {**BERT, "decoder_bias": True, "position_offset": 2}])
def test_gradients_match_finite_differences_in_float64(overrides):
    cfg = ModelConfig(**{**MICRO.__dict__, **overrides})
    params = {k: v.double() * 10 if v.ndim == 2 else v.double() for k, v in model.init(cfg, seed=0).items()}
    batch = random_batch(cfg, batch=2, per_seq=2)
    names = list(params)

    def loss(*tensors):
        return model.mlm_loss(dict(zip(names, tensors)), cfg, batch)[0]

    inputs = tuple(p.clone().requires_grad_() for p in params.values())
    # fast_mode compares directional derivatives along random vectors: a few evaluations, not one per entry.
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


def test_matches_modernbert_from_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(
        vocab_size=97, hidden=32, layers=3, heads=4, intermediate=64, max_seq_len=16, norm_eps=1e-5, **MODERNBERT
    )
    params = {k: v * 10 if v.ndim == 2 else v + 0.1 * torch.randn_like(v) for k, v in model.init(cfg, seed=0).items()}
    hf = transformers.ModernBertForMaskedLM(
        transformers.ModernBertConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            norm_eps=1e-5,
            layer_types=["full_attention"] * 3,
            global_rope_theta=cfg.rope_theta,
            decoder_bias=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            max_position_embeddings=16,
        )
    ).eval()
    # The export's mapping; the decoder is tied to the token embeddings, so it is the one name left out.
    loaded = hf.load_state_dict(to_transformers(cfg, params, {"cls": 1, "sep": 2})[1], strict=False)
    assert loaded.missing_keys == ["decoder.weight"] and loaded.unexpected_keys == []
    assert hf.decoder.weight is hf.model.embeddings.tok_embeddings.weight
    ids = torch.randint(3, 97, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 11:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
    ours = model.mlm_logits(params, cfg, model.encode(params, cfg, ids, mask))
    assert torch.allclose(ours[mask], expected[mask], atol=1e-4)


def test_adamw_matches_torch_optim_with_clipping():
    cfg = AdamW(weight_decay=0.1, clip_norm=0.5)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "norm": torch.randn(3, generator=gen)}
    reference = {k: v.clone().requires_grad_() for k, v in params.items()}
    optim = torch.optim.AdamW(
        [{"params": [reference["w"]]}, {"params": [reference["norm"]], "weight_decay": 0.0}],
        lr=0.01,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    state = model.optimizer_init(model.AdamW(), params)
    for step in range(4):
        grads = {k: torch.randn(v.shape, generator=gen) * (step + 1) for k, v in params.items()}
        for k, p in reference.items():
            p.grad = grads[k].clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(list(reference.values()), cfg.clip_norm)
        optim.step()
        params, state, grad_norm = model.optimizer_update(cfg, params, state, grads, torch.tensor(0.01))
        assert grad_norm.item() == pytest.approx(expected_norm.item(), rel=1e-6)
        for k in params:
            assert torch.allclose(params[k], reference[k].detach(), rtol=1e-6, atol=1e-7), (step, k)
    assert state["step"].item() == 4
    assert set(state) == {"step", "exp_avg.w", "exp_avg.norm", "exp_avg_sq.w", "exp_avg_sq.norm"}


def _stable_adamw_reference(params, grads_per_step, lr, betas, eps, weight_decay):
    """Wortsman et al. 2023, Algorithm 2 (StableAdamW), written out in float64 with Python scalars for
    the per-tensor factors: m, v; m_hat, v_hat; RMS = sqrt(mean(g^2 / max(v_hat, eps^2))); eta = lr / max(1, RMS);
    theta -= eta * (weight_decay * theta (matrices only) + m_hat / (sqrt(v_hat) + eps))."""
    b1, b2 = betas
    theta = {k: v.double().clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    v = {k: torch.zeros_like(t) for k, t in theta.items()}
    etas = []
    for t, grads in enumerate(grads_per_step, start=1):
        etas.append({})
        for k in theta:
            g = grads[k].double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            rms = math.sqrt(float((g * g / v_hat.clamp(min=eps * eps)).mean()))
            eta = lr / max(1.0, rms)
            etas[-1][k] = eta
            decay = weight_decay * theta[k] if theta[k].ndim >= 2 else 0.0
            theta[k] = theta[k] - eta * decay - eta * m_hat / (v_hat.sqrt() + eps)
    return theta, etas


def test_stable_adamw_matches_the_published_update_rule_through_a_gradient_spike():
    cfg = StableAdamW(weight_decay=0.1, clip_norm=0.0, eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4, 3, generator=gen),
        "emb": torch.randn(6, 2, generator=gen),
        "norm": torch.randn(3, generator=gen),
    }
    grads_per_step = []
    for step in range(5):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        if step == 3:
            grads["w"] = grads["w"] * 1000.0  # a spike far above w's running second moment
        grads_per_step.append(grads)
    expected, etas = _stable_adamw_reference(params, grads_per_step, 0.01, cfg.betas, cfg.eps, cfg.weight_decay)
    # The spike is clipped (w's rate about halved, the most a spike gets at beta2 0.98 and step 4: RMS is
    # at most sqrt((1 - beta2^t) / (1 - beta2))); the other steps of w and the other tensors hardly are,
    # so the test covers both branches of max(1, RMS).
    assert etas[3]["w"] < 0.6 * 0.01 and min(e["w"] for i, e in enumerate(etas) if i != 3) > 0.009
    assert sum(eta == 0.01 for e in etas for eta in e.values()) >= 5  # unclipped: max(1, RMS) = 1
    state = model.optimizer_init(model.AdamW(), params)
    for grads in grads_per_step:
        params, state, _ = model.optimizer_update(cfg, params, state, grads, torch.tensor(0.01))
    for k in params:
        assert torch.allclose(params[k].double(), expected[k], rtol=1e-5, atol=1e-6), k
    plain = AdamW(weight_decay=0.1, clip_norm=0.0, eps=1e-8)
    unclipped, state = dict(params), model.optimizer_init(model.AdamW(), params)
    for grads in grads_per_step:
        unclipped, state, _ = model.optimizer_update(plain, unclipped, state, grads, torch.tensor(0.01))
    assert not torch.allclose(unclipped["w"], params["w"], atol=1e-4)  # AdamW takes the spike's full step


def test_optimizer_kind_is_checked():
    with pytest.raises(ValueError, match="optimizer.kind='lion': allowed adamw, stable_adamw"):
        optimizer_config("lion")


def test_schedules():
    assert set(model.SCHEDULES) == {"constant", "budget-triangle", "one-cycle", "cosine", "wsd"}
    triangle = [model.lr_schedule("budget-triangle", p) for p in (0.0, 0.375, 0.75, 0.875, 1.0)]
    assert triangle == pytest.approx([0.25, 0.625, 1.0, 0.5, 0.0])
    assert [model.lr_schedule("one-cycle", p) for p in (0.0, 0.25, 0.5, 1.0)] == pytest.approx([0, 0.5, 1, 0])
    assert [model.lr_schedule("cosine", p, warmup=0.2) for p in (0.1, 0.2, 0.6, 1.0)] == pytest.approx([0.5, 1, 0.5, 0])
    wsd = [model.lr_schedule("wsd", p, warmup=0.1, decay=0.2) for p in (0.05, 0.5, 0.9, 1.0)]
    assert wsd == pytest.approx([0.5, 1, 0.5, 0])
    assert model.lr_schedule("constant", 2.0) == 1.0
    assert model.lr_schedule("budget-triangle", 1.5) == 0.0  # progress past the budget clamps to its end
    with pytest.raises(ValueError, match="allowed"):
        model.lr_schedule("linear", 0.5)
    with pytest.raises(ValueError, match="decay=0"):
        model.lr_schedule("wsd", 0.5, decay=0.0)


def test_decay_shapes_and_floor():
    wsd = dict(warmup=0.1, decay=0.2)
    # At a quarter of wsd's decay (p = 0.85): linear 0.75, cosine (1 + cos(pi/4)) / 2, 1-sqrt 1 - 0.5.
    at_quarter = {shape: model.lr_schedule("wsd", 0.85, shape, **wsd) for shape in model.DECAY_SHAPES}
    assert at_quarter == pytest.approx({"linear": 0.75, "cosine": (1 + math.sqrt(0.5)) / 2, "1-sqrt": 0.5})
    # The floor: the decay ends at decay_to, and the value in between is lifted by (1 - decay_to).
    floored = [model.lr_schedule("wsd", p, "1-sqrt", 0.02, **wsd) for p in (0.05, 0.5, 0.8, 0.85, 1.0)]
    assert floored == pytest.approx([0.5, 1.0, 1.0, 0.02 + 0.98 * 0.5, 0.02])
    # The budget-driven shapes: the triangle's last quarter, one-cycle's second half, cosine after warmup.
    assert model.lr_schedule("budget-triangle", 0.8125, "1-sqrt") == pytest.approx(0.5)
    assert model.lr_schedule("budget-triangle", 0.5, "1-sqrt", 0.1) == pytest.approx(0.25 + 0.5 * 0.75 / 0.75)
    assert model.lr_schedule("budget-triangle", 1.0, "cosine", 0.1) == pytest.approx(0.1)
    assert model.lr_schedule("one-cycle", 0.75, "cosine") == pytest.approx(0.5)
    assert model.lr_schedule("one-cycle", 0.625, "1-sqrt", 0.2) == pytest.approx(0.2 + 0.8 * 0.5)
    assert model.lr_schedule("cosine", 0.8, "linear", warmup=0.2) == pytest.approx(0.25)
    assert model.lr_schedule("cosine", 0.8, warmup=0.2) == pytest.approx((1 + math.cos(0.75 * math.pi)) / 2)
    # "" is the schedule's own shape: the triangle's linear decay as before.
    assert model.lr_schedule("budget-triangle", 0.875) == model.lr_schedule("budget-triangle", 0.875, "linear")
    with pytest.raises(ValueError, match="decay_shape 'sqrt': allowed linear, cosine, 1-sqrt"):
        model.lr_schedule("wsd", 0.9, "sqrt")
    with pytest.raises(ValueError, match=r"decay_to 1.0: allowed \[0, 1\)"):
        model.lr_schedule("wsd", 0.9, decay_to=1.0)
    with pytest.raises(ValueError, match="'constant' has no decay"):
        model.lr_schedule("constant", 0.9, decay_to=0.1)


def test_norm_bias_adds_a_zero_bias_to_every_norm_and_trains_it():
    cfg = ModelConfig(**SMALL, **MODERNBERT, norm_bias=True)
    params = model.init(cfg, seed=0)
    plain = model.init(ModelConfig(**SMALL, **MODERNBERT), seed=0)
    norms = {name.removesuffix(".weight") for name in plain if "norm" in name}
    biases = {name.removesuffix(".bias") for name in params if name.endswith(".bias")}
    assert biases == norms and len(norms) == 3 + 2 + 3  # ffn norms, attn norms (none in layer 0), embed+final+head
    assert all(not params[n + ".bias"].any() for n in norms) and params.keys() - plain.keys() == {
        n + ".bias" for n in norms
    }
    batch = random_batch(cfg, batch=2, per_seq=3)
    # Zero biases: the same function as without them, until training moves them.
    assert torch.equal(
        model.mlm_loss(params, cfg, batch)[0], model.mlm_loss(plain, ModelConfig(**SMALL, **MODERNBERT), batch)[0]
    )
    grads = torch.func.grad(lambda p: model.mlm_loss(p, cfg, batch)[0])(params)
    assert all(grads[n + ".bias"].abs().sum() > 0 for n in norms)
    moved = {**params, "final_norm.bias": torch.full((32,), 0.5)}
    assert not torch.equal(model.mlm_loss(moved, cfg, batch)[0], model.mlm_loss(params, cfg, batch)[0])


def _counted_step_flops(cfg: ModelConfig, opt: OptimizerConfig, batch: int, masked: int) -> int:
    """Matmul FLOPs of one eager training step as torch's FlopCounterMode counts the ops that ran."""
    from torch.utils.flop_counter import FlopCounterMode

    params = model.init(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    S = cfg.max_seq_len
    data = {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, S), generator=gen),
        "mlm_positions": torch.arange(batch * masked) * (S // masked),
        "mlm_labels": torch.randint(1, cfg.vocab_size, (batch * masked,), generator=gen),
    }
    step = model.make_train_step(cfg, opt, model.EAGER)
    with FlopCounterMode(display=False) as counter:
        step(params, model.optimizer_init(model.AdamW(), params), data, torch.tensor(1e-3))
    return counter.get_total_flops()


def test_step_gemms_are_every_matmul_a_training_step_runs_and_flops_per_token_less_norms():
    cfg = ModelConfig(**SMALL, **MODERNBERT)
    gemms = model.step_gemms(cfg, batch=2, masked_per_seq=32)
    total = sum(g.flops for g in gemms)
    assert total == _counted_step_flops(cfg, AdamW(), batch=2, masked=32)
    # By hand: the layers' matrices 3·(96 + 32 + 64 + 32)·32 = 21,504 and attention, 6·21,504 + 147,456 per
    # token; the head's dense 1,024 and the decoder 3,200 for the masked quarter: 6·4,224·0.25 = 6,336.
    assert total == 256 * (6 * 21_504 + 147_456 + 6_336)
    assert len(gemms) == 3 * 8  # qkv, scores, values, out, up, down, head dense, decoder: each with its two gradients


def test_optimizer_flops_are_muons_newton_schulz_by_hand_and_as_counted():
    cfg = ModelConfig(**SMALL, **MODERNBERT)
    # Every hidden matrix is a stack of [32, 32] blocks (qkv 3, out 1, GLU up 2, down 1): per block and
    # iteration 4·32³ + 2·32³, five iterations: 983,040; 7 blocks a layer, 3 layers.
    by_hand = 3 * 7 * 5 * 6 * 32**3
    assert model.optimizer_flops(cfg, Muon()) == by_hand == 20_643_840
    assert model.optimizer_flops(cfg, AdamW()) == 0
    muon_step = _counted_step_flops(cfg, Muon(), batch=2, masked=32)
    assert muon_step - _counted_step_flops(cfg, AdamW(), batch=2, masked=32) == by_hand
