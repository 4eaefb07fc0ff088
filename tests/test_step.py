"""The compiled steps: one graph each, no recompiles, inductor == eager, accumulation, all-reduce, bf16."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cram import model
from cram.model import AdamW, ModelConfig, StableAdamW
from cram.stages.shared.special import SPECIAL_IDS

TINY = model.PRESETS["tiny"]
# The smallest model that still has every part: compile time grows with the layer count.
TINIEST = ModelConfig(vocab_size=256, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=16)
OPT = AdamW()
# Comparing params after AdamW steps of differently summed gradients: with eps=1e-12 the first
# update is sign(grad) * lr, so a rounding-level gradient (some are ~1e-12) may flip by 2*lr.
# A larger eps makes the update continuous in the gradient.
SMOOTH_OPT = AdamW(eps=1e-6)


def random_batch(cfg: ModelConfig, batch: int, seed: int, per_seq: int | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    S = cfg.max_seq_len
    per_seq = per_seq or S // 4
    chosen = torch.rand(batch, S, generator=gen).argsort(dim=1)[:, :per_seq]
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, S), generator=gen),
        "mlm_positions": (chosen + S * torch.arange(batch)[:, None]).flatten(),
        "mlm_labels": torch.randint(1, cfg.vocab_size, (batch * per_seq,), generator=gen),
    }


def fresh(cfg: ModelConfig = TINY, seed: int = 0):
    params = model.init(cfg, seed)
    return params, model.optimizer_init(model.AdamW(), params)


def zeros_like(params):
    return {name: torch.zeros_like(p) for name, p in params.items()}


STABLE = StableAdamW(clip_norm=0.0)


STEPS = ["train", "train-stable", "train-bf16", "accumulate", "apply", "apply-stable", "eval"]


@pytest.mark.parametrize("which", STEPS)
def test_each_step_is_one_graph_without_breaks(which):
    params, state = fresh(TINIEST)
    batch, lr = random_batch(TINIEST, 2, seed=0), torch.tensor(1e-3)
    fn, args = {
        "train": (model.make_train_step(TINIEST, OPT, model.EAGER), (params, state, batch, lr)),
        "train-stable": (model.make_train_step(TINIEST, STABLE, model.EAGER), (params, state, batch, lr)),
        "apply-stable": (model.make_apply_step(STABLE, model.EAGER), (params, state, params, torch.tensor(2.0), lr)),
        "train-bf16": (
            model.make_train_step(TINIEST, OPT, model.Compilation(compile=False, autocast=torch.bfloat16)),
            (params, state, batch, lr),
        ),
        "accumulate": (model.make_accumulate_step(TINIEST, model.EAGER), (params, zeros_like(params), batch)),
        "apply": (model.make_apply_step(OPT, model.EAGER), (params, state, params, torch.tensor(2.0), lr)),
        "eval": (model.make_eval_step(TINIEST, model.EAGER), (params, batch)),
    }[which]
    explanation = torch._dynamo.explain(fn)(*args)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


# The layouts of existing checkpoints (model/hf.py): ModernBERT's local/global layers, BERT's post-norm
# blocks with biases, and packed documents kept apart by document_ids.
LAYOUTS = {
    "modernbert-local": dict(
        layers=3,
        position="rope",
        head_transform=True,
        first_attn_norm=False,
        local_attention=4,
        global_every=2,
        local_rope_theta=500.0,
        decoder_bias=True,
    ),
    "bert": dict(
        position="learned",
        position_offset=2,
        glu=False,
        head_transform=True,
        post_norm=True,
        linear_bias=True,
        norm_bias=True,
        token_types=2,
        decoder_bias=True,
    ),
    "document_ids": dict(layers=2, position="rope", local_attention=4, global_every=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_layouts_compile_the_train_step_to_one_graph(layout):
    cfg = ModelConfig(**{**TINIEST.__dict__, **LAYOUTS[layout]})
    params, state = fresh(cfg)
    batch = random_batch(cfg, 2, seed=0)
    batch["attention_mask"] = torch.ones(2, cfg.max_seq_len, dtype=torch.bool)
    batch["attention_mask"][1, 12:] = False
    if layout == "document_ids":
        batch["document_ids"] = (torch.arange(cfg.max_seq_len) >= 5).long().expand(2, -1).contiguous()
    step = model.make_train_step(cfg, OPT, model.EAGER)
    explanation = torch._dynamo.explain(step)(params, state, batch, torch.tensor(1e-3))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def test_new_batches_lrs_evals_and_microbatch_counts_never_recompile():
    counters = torch._dynamo.utils.counters["stats"]
    graphs_before = counters["unique_graphs"]
    params, state = fresh(TINIEST)
    with torch._dynamo.config.patch(error_on_recompile=True):
        train = model.make_train_step(TINIEST, OPT, model.Compilation(backend="aot_eager"))
        evaluate = model.make_eval_step(TINIEST, model.Compilation(backend="aot_eager"))
        accumulate = model.make_accumulate_step(TINIEST, model.Compilation(backend="aot_eager"))
        apply = model.make_apply_step(OPT, model.Compilation(backend="aot_eager"))
        for i in range(20):
            lr = torch.tensor(1e-3 * model.lr_schedule("budget-triangle", i / 20))
            params, state, metrics = train(params, state, random_batch(TINIEST, 4, seed=i), lr)
            if i % 5 == 0:
                evaluate(params, random_batch(TINIEST, 4, seed=100 + i))
        for n_micro in (1, 3, 2):
            grads = zeros_like(params)
            for j in range(n_micro):
                grads, _ = accumulate(params, grads, random_batch(TINIEST, 4, seed=200 + j))
            params, state, _ = apply(params, state, grads, torch.tensor(float(n_micro)), torch.tensor(5e-4))
        # A step made for another model has its own cache: neither disturbs the other.
        other_cfg = ModelConfig(**{**TINIEST.__dict__, "hidden": 64})
        other_params, other_state = fresh(other_cfg)
        model.make_train_step(other_cfg, OPT, model.Compilation(backend="aot_eager"))(
            other_params, other_state, random_batch(other_cfg, 4, seed=0), torch.tensor(1e-3)
        )
        params, state, metrics = train(params, state, random_batch(TINIEST, 4, seed=99), torch.tensor(1e-4))
    assert counters["unique_graphs"] - graphs_before == 5
    assert state["step"].item() == 24
    assert set(metrics) == {"loss", "grad_norm", "accuracy"} and all(m.ndim == 0 for m in metrics.values())
    assert all(torch.isfinite(m) for m in metrics.values())


def test_the_stable_adamw_step_never_recompiles_and_matches_eager():
    counters = torch._dynamo.utils.counters["stats"]
    graphs_before = counters["unique_graphs"]
    runs = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for compiled in (False, True):
            params, state = fresh(TINIEST)
            train = model.make_train_step(TINIEST, STABLE, model.Compilation(compile=compiled, backend="aot_eager"))
            for i in range(8):
                lr = torch.tensor(1e-3 * model.lr_schedule("wsd", i / 8, "1-sqrt", 0.02))
                params, state, metrics = train(params, state, random_batch(TINIEST, 4, seed=i), lr)
            runs[compiled] = params
    assert counters["unique_graphs"] - graphs_before == 1
    for name, p in runs[False].items():
        assert torch.allclose(runs[True][name], p, rtol=0, atol=1e-6), name


def test_inductor_matches_eager_over_ten_steps():
    lr = torch.tensor(1e-3)
    runs = {}
    for compiled in (False, True):
        params, state = fresh(TINIEST)
        step = model.make_train_step(TINIEST, OPT, model.Compilation(compile=compiled, backend="inductor"))
        losses = []
        for i in range(10):
            params, state, metrics = step(params, state, random_batch(TINIEST, 8, seed=i % 2), lr)
            losses.append(metrics["loss"])
        runs[compiled] = torch.stack(losses), params
    (eager_losses, eager_params), (compiled_losses, compiled_params) = runs[False], runs[True]
    assert torch.allclose(compiled_losses, eager_losses, rtol=1e-5, atol=0)
    for name, p in eager_params.items():
        assert torch.allclose(compiled_params[name], p, rtol=0, atol=1e-4), name
    assert eager_losses[-2:].mean() < eager_losses[:2].mean()  # two batches seen 5 times: it learns them


def test_compiled_fp32_gradients_match_float64():
    params = model.init(TINIEST, seed=0)
    batch = random_batch(TINIEST, 2, seed=0)
    grads, _ = model.make_accumulate_step(TINIEST, model.Compilation(backend="aot_eager"))(
        params, zeros_like(params), batch
    )
    exact = torch.func.grad(lambda p: model.mlm_loss(p, TINIEST, batch)[0])({k: v.double() for k, v in params.items()})
    for name, g in grads.items():
        assert torch.allclose(g.double(), exact[name], rtol=1e-3, atol=1e-7), name


def test_two_accumulated_microbatches_equal_one_step_on_both():
    params, state = fresh()
    halves = [random_batch(TINY, 4, seed=s) for s in (1, 2)]
    both = {
        "input_ids": torch.cat([h["input_ids"] for h in halves]),
        "mlm_positions": torch.cat([halves[0]["mlm_positions"], halves[1]["mlm_positions"] + 4 * TINY.max_seq_len]),
        "mlm_labels": torch.cat([h["mlm_labels"] for h in halves]),
    }
    accumulate = model.make_accumulate_step(TINY, model.EAGER)
    grads, losses = zeros_like(params), []
    for half in halves:
        grads, metrics = accumulate(params, grads, half)
        losses.append(metrics["loss"])
    big_grads, big = accumulate(params, zeros_like(params), both)
    assert torch.stack(losses).mean().item() == pytest.approx(big["loss"].item(), rel=1e-5)
    for name, g in big_grads.items():
        assert torch.allclose(grads[name] / 2, g, rtol=1e-4, atol=1e-8), name

    lr = torch.tensor(1e-3)
    expected, _, one_step = model.make_train_step(TINY, SMOOTH_OPT, model.EAGER)(params, state, both, lr)
    apply = model.make_apply_step(SMOOTH_OPT, model.EAGER)
    got, _, applied = apply(params, state, grads, torch.tensor(2.0), lr)
    assert applied["grad_norm"].item() == pytest.approx(one_step["grad_norm"].item(), rel=1e-5)
    for name, p in expected.items():
        assert torch.allclose(got[name], p, atol=1e-6), name


def test_bf16_autocast_keeps_fp32_master_weights():
    params, state = fresh()
    batch, lr = random_batch(TINY, 4, seed=0), torch.tensor(1e-3)
    _, _, fp32 = model.make_train_step(TINY, OPT, model.EAGER)(params, state, batch, lr)
    new_params, new_state, bf16 = model.make_train_step(
        TINY, OPT, model.Compilation(compile=False, autocast=torch.bfloat16)
    )(params, state, batch, lr)
    assert all(t.dtype == torch.float32 for t in (*new_params.values(), *new_state.values()))
    assert bf16["loss"].dtype == torch.float32
    assert bf16["loss"].item() == pytest.approx(fp32["loss"].item(), rel=1e-2)


def test_a_compilations_eager_twin_keeps_its_forward_and_gives_the_same_numbers():
    how = model.Compilation(backend="aot_eager", autocast=torch.bfloat16, attention="written", options={"x": 1})
    eager = how.eager()
    assert (eager.compile, eager.options) == (False, None)
    assert (eager.backend, eager.autocast, eager.attention) == ("aot_eager", torch.bfloat16, "written")
    params, _ = fresh(TINIEST)
    batch = random_batch(TINIEST, 2, seed=0)
    in_bf16 = model.make_eval_step(TINIEST, eager)(params, batch)["loss"]
    in_fp32 = model.make_eval_step(TINIEST, model.EAGER)(params, batch)["loss"]
    assert in_bf16.item() != in_fp32.item()  # the twin still autocasts
    assert in_bf16.item() == pytest.approx(in_fp32.item(), rel=1e-2)


def _all_reduce_rank(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    params, state = fresh(TINIEST)
    reduce = model.make_grad_all_reduce(world_size)
    step = model.make_train_step(TINIEST, SMOOTH_OPT, model.Compilation(backend="aot_eager"), reduce_grads=reduce)
    params, _, _ = step(params, state, random_batch(TINIEST, 4, seed=rank), torch.tensor(1e-3))
    torch.save(params, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_grad_all_reduce_inside_the_compiled_step_averages_ranks(tmp_path):
    mp.spawn(_all_reduce_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    params, state = fresh(TINIEST)
    accumulate = model.make_accumulate_step(TINIEST, model.EAGER)
    grads = zeros_like(params)
    for rank in range(2):
        grads, _ = accumulate(params, grads, random_batch(TINIEST, 4, seed=rank))
    apply = model.make_apply_step(SMOOTH_OPT, model.EAGER)
    expected, _, _ = apply(params, state, grads, torch.tensor(2.0), torch.tensor(1e-3))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, p in expected.items():
            assert torch.allclose(got[name], p, atol=1e-6), (rank, name)


def fake_pack(folder: Path, train_blocks: int, vocab: int = 300, seq_len: int = 32) -> Path:
    import json

    import numpy as np

    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(5, vocab, (train_blocks, seq_len), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(5, vocab, (8, seq_len), dtype=np.uint16))
    meta = {"train": "train.npy", "val": "val.npy", "seq_len": seq_len, "vocab_size": vocab, "special_ids": SPECIAL_IDS}
    (folder / "pack.json").write_text(json.dumps(meta))
    return folder


def quality_bench(*flags: str, timeout: int = 60) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, str(root / "bench" / "quality.py"), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(root)},
    )


def test_quality_bench_refuses_a_budget_that_would_repeat_blocks(tmp_path):
    pack = fake_pack(tmp_path / "pack", train_blocks=10)
    done = quality_bench(str(pack), "--tokens", "1000", "--batch", "4", "--models", "cram")
    assert done.returncode == 2
    assert "holds 320 training tokens (10 blocks)" in done.stderr and "--max-epochs 4" in done.stderr
    assert "Traceback" not in done.stderr
    bad = quality_bench(str(pack), "--models", "cram", "--variant", "x:hidden_size=3")
    assert bad.returncode == 2 and "unknown key 'hidden_size'" in bad.stderr


@pytest.mark.slow
def test_quality_bench_trains_every_model_on_the_same_batches(tmp_path):
    pytest.importorskip("transformers")
    pack = fake_pack(tmp_path / "pack", train_blocks=16)
    flags = [
        "--batch",
        "4",
        "--tokens",
        "256",
        "--evals",
        "2",
        "--lrs",
        "3e-3",
        "--speed-rounds",
        "1",
        "--val-blocks",
        "4",
        "--backend",
        "aot_eager",
        "--variant",
        "crammed:position=sinusoidal,norm_bias=true",
    ]
    done = quality_bench(str(pack), *flags, "--json", str(tmp_path / "out.json"), timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for row in ("cram compiled", "cram eager", "bert compiled, dense logits", "modernbert compiled"):
        assert f"| {row} |" in out
    assert "## held-out MLM loss vs training tokens" in out and "## held-out MLM loss at equal wall time" in out
    import json

    report = json.loads((tmp_path / "out.json").read_text())
    assert set(report["curves"]) == {"cram", "bert", "modernbert", "crammed"}
    for curves in report["curves"].values():
        (curve,) = curves.values()
        assert curve["tokens"] == [128, 256] and all(5.0 < loss < 6.5 for loss in curve["loss"])  # ~log(300)


def test_quality_bench_takes_phases_and_a_masking_schedule(tmp_path):
    pack = fake_pack(tmp_path / "pack", train_blocks=16)
    flags = ["--models", "cram", "--batch", "4", "--tokens", "512", "--evals", "2", "--lrs", "3e-3", "--no-speed"]
    variant = ["--variant", "long:phases=16@0.5/32,mask_rate=0.4,end_rate=0.2"]
    done = quality_bench(str(pack), *flags, *variant, "--json", str(tmp_path / "out.json"), timeout=300)
    assert done.returncode == 0, done.stderr
    import json

    curves = json.loads((tmp_path / "out.json").read_text())["curves"]
    assert set(curves) == {"cram", "long"} and curves["long"]["0.003"]["tokens"] == [256, 512]
    bad = quality_bench(str(pack), *flags, "--variant", "x:phases=12@0.5/32")
    assert bad.returncode == 2 and "pretrain.phases[0].seq_len: 12 must divide" in bad.stderr


def test_the_inductor_switches_reach_torch_compile_as_its_config_keys(monkeypatch):
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    how = model.Compilation(max_autotune=True, combo_kernels=True, options={"cpp.simdlen": 256})
    model.make_eval_step(TINIEST, how)
    assert seen["options"] == {"cpp.simdlen": 256, "max_autotune": True, "combo_kernels": True}
    assert (seen["fullgraph"], seen["dynamic"], seen["backend"]) == (True, False, "inductor")
    model.make_eval_step(TINIEST, model.Compilation(backend="aot_eager", max_autotune=True))
    assert seen["options"] is None  # another backend has no inductor keys to read
    model.make_eval_step(TINIEST, model.Compilation())
    assert seen["options"] is None


def test_cuda_graphs_off_cuda_are_refused_when_the_step_is_called():
    params, state = fresh(TINIEST)
    how = model.Compilation(backend="aot_eager", cuda_graphs=True)
    step = model.make_train_step(TINIEST, OPT, how)
    with pytest.raises(ValueError, match="cuda_graphs=True: CUDA graphs need a CUDA device; .* on cpu"):
        step(params, state, random_batch(TINIEST, 2, seed=0), torch.tensor(1e-3))
    assert model.Compilation(cuda_graphs=True).backend_options() == {"triton.cudagraphs": True}
