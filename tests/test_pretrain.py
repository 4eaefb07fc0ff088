"""The pretrain stage: batches and masks, budgets, the ramp, the NaN guard, exact resume after a
SIGKILL, and data parallelism over 2 gloo processes. A 1-layer, 32-wide model on random tokens keeps
each run to a second or two."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs
from test_precision import wrong_in_bf16

from cram.stages import StageError, Upstream, pretrain
from cram.stages.pretraining import checkpoint, hooks
from cram.stages.pretraining import loop as training
from cram.stages.pretraining.batches import Feed, Prefetcher, read_sequences
from cram.stages.pretraining.budget import progress as budget_progress
from cram.stages.pretraining.state import TrainState
from cram.stages.shared import device as devices
from cram.stages.shared.masking import MaskSpec, mask_tokens
from cram.stages.shared.precision import CanaryError
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 256, 32
# Both precisions for the compiled tests, bf16 where the CPU multiplies it natively (emulated, it is only
# slow). The compiled ones use aot_eager: inductor's bf16 step is checked per layout in test_precision.py.
PRECISIONS = [
    "fp32",
    pytest.param("bf16", marks=pytest.mark.skipif(not devices.native_cpu_bf16(), reason="this CPU has no native bf16")),
]


@pytest.fixture
def pack(tmp_path) -> Upstream:
    """A packed-data upstream of random tokens (the layout `stages.pack` writes)."""
    folder = tmp_path / "pack"
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(5, VOCAB, size=(512, SEQ), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(5, VOCAB, size=(64, SEQ), dtype=np.uint16))
    outputs = {"train": "train.npy", "val": "val.npy", "seq_len": SEQ, "vocab_size": VOCAB, "special_ids": SPECIAL_IDS}
    return Upstream(folder, outputs)


def small(**kw) -> pretrain.Config:
    defaults = dict(
        model=pretrain.Architecture(hidden=32, layers=1, heads=2, intermediate=64),
        budget=pretrain.Budget(steps=6),
        microbatch=8,
        batch_size=8,
        ramp=0.0,
        compile=False,
        log_every_steps=1,
        checkpoint_every_minutes=0,
        val_blocks=16,
        precision="fp32",  # "auto" would take the bf16 path on some CPUs and fp32 on others
    )
    return pretrain.Config(**{**defaults, **kw})


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# --- batches and masks ---------------------------------------------------------------------------


def test_stream_is_a_permutation_per_epoch_and_shards_by_rank():
    blocks = np.arange(10 * 4, dtype=np.uint16).reshape(10, 4)
    first_two_epochs = read_sequences(blocks, seed=1, first=0, count=20, orders={})[:, 0] // 4
    assert sorted(first_two_epochs[:10]) == list(range(10)) == sorted(first_two_epochs[10:])
    assert list(first_two_epochs[:10]) != list(first_two_epochs[10:])

    # Two ranks of microbatch 2 read, between them, what one rank of microbatch 2 reads in order.
    def stream(rank, world, n):
        with Prefetcher(blocks, Feed(1, rank, world), start=4, microbatch=2) as data:
            return [data.next() for _ in range(n)]

    alone = stream(0, 1, 4)
    r0, r1 = stream(0, 2, 2), stream(1, 2, 2)
    interleaved = [r0[0], r1[0], r0[1], r1[1]]
    assert [m.first for m in interleaved] == [m.first for m in alone] == [4, 6, 8, 10]
    assert all(torch.equal(a.ids, b.ids) and a.mask_seed == b.mask_seed for a, b in zip(alone, interleaved))


def test_masking_picks_exactly_k_non_special_positions():
    spec = MaskSpec(per_sequence=8, mask_id=4, vocab_size=VOCAB, special_ids=tuple(SPECIAL_IDS.values()))
    ids = torch.randint(5, VOCAB, (64, SEQ))
    ids[:, 0], ids[:, -1] = SPECIAL_IDS["cls"], SPECIAL_IDS["sep"]
    batch = mask_tokens(ids, spec, torch.Generator().manual_seed(0))
    rows = batch["mlm_positions"].view(64, 8) // SEQ
    cols = batch["mlm_positions"].view(64, 8) % SEQ
    assert (rows == torch.arange(64)[:, None]).all()  # K per sequence, each in its own row
    assert all(len(set(c.tolist())) == 8 for c in cols) and not ((cols == 0) | (cols == SEQ - 1)).any()
    assert torch.equal(batch["mlm_labels"], ids.view(-1)[batch["mlm_positions"]])
    corrupted = batch["input_ids"].view(-1)[batch["mlm_positions"]]
    masked = (corrupted == 4).float().mean().item()
    kept = (corrupted == batch["mlm_labels"]).float().mean().item()
    assert 0.75 < masked < 0.85 and 0.08 < kept < 0.16  # 80% [MASK], 10% random, 10% (+ chance) kept
    untouched = torch.ones(64 * SEQ, dtype=torch.bool)
    untouched[batch["mlm_positions"]] = False
    assert torch.equal(batch["input_ids"].view(-1)[untouched], ids.view(-1)[untouched])


def test_ramp_reaches_the_target_batch_at_the_ramp_fraction():
    assert [training.micro_steps(p, 0.5, 4) for p in (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.9)] == [1, 1, 2, 3, 4, 4, 4]
    assert training.micro_steps(0.0, 0.0, 4) == 4


def test_checkpoints_are_renamed_into_place_and_pruned(tmp_path):
    tensors = {"w": torch.ones(2, 2)}
    (tmp_path / ".tmp-step-9-123").mkdir()  # a killed write
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, tensors, {"step": torch.tensor(1.0)}, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    params, opt_state, state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state == {"step": 3} and torch.equal(params["w"], tensors["w"])


# --- the stage -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, steps",
    [
        (pretrain.Budget(steps=5), 5),
        (pretrain.Budget(tokens=3 * 8 * SEQ + 1), 4),  # stops at the first step past it
        (pretrain.Budget(steps=50, tokens=2 * 8 * SEQ), 2),  # the first limit wins
    ],
)
def test_budget_by_steps_and_tokens(pack, tmp_path, make_ctx, budget, steps):
    out = pretrain.run(small(budget=budget), {"pack": pack}, tmp_path / "out", make_ctx())
    assert out["steps"] == steps and out["tokens_seen"] == steps * 8 * SEQ
    assert [m["step"] for m in metrics(tmp_path / "out")] == list(range(1, steps + 1))
    saved = json.loads((tmp_path / "out" / out["model_config"]).read_text())
    assert saved["vocab_size"] == VOCAB and saved["hidden"] == 32 and saved["max_seq_len"] == SEQ
    assert load_file(tmp_path / "out" / out["params"])["embed.tokens.weight"].dtype == torch.float32


def test_budget_by_time_counts_training_not_compiling(pack, tmp_path, make_ctx):
    config = small(budget=pretrain.Budget(hours=1.5 / 3600), compile=True, backend="aot_eager", log_every_steps=1)
    out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert out["wall_s"] >= 1.5 and out["compile_s"] > 0
    # It stops at the first step past the budget (how far past, in seconds, is bench/'s to measure); each row
    # shows the progress the loop read after its step.
    progress = [m["progress"] for m in metrics(tmp_path / "out")]
    assert len(progress) == out["steps"] and progress[-1] >= 1.0 and all(p < 1.0 for p in progress[:-1])


def test_ramp_grows_accumulation_without_recompiling(pack, tmp_path, make_ctx):
    config = small(budget=pretrain.Budget(steps=8), batch_size=32, ramp=0.5, compile=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert [m["batch_size"] for m in metrics(tmp_path / "out")] == [8, 16, 24, 32, 32, 32, 32, 32]
    assert out["tokens_seen"] == (8 + 16 + 24 + 5 * 32) * SEQ


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch_size, graphs", [(8, 1), (16, 2)], ids=["one-graph", "accumulate-apply"])
def test_a_step_is_one_graph_or_accumulate_and_apply_and_trains_as_eager(
    pack, tmp_path, make_ctx, batch_size, graphs, precision
):
    """batch_size = microbatch: the whole step is one graph; batch_size 2 x microbatch: two graphs,
    accumulate (twice a step) and apply. Either trains as the same steps run eagerly."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a graph another test compiled for the same step would not be counted
    before = counters["stats"]["unique_graphs"]
    config = small(budget=pretrain.Budget(steps=3), batch_size=batch_size, precision=precision)
    compiled = dataclasses.replace(config, compile=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = pretrain.run(compiled, {"pack": pack}, tmp_path / "out", make_ctx())
    assert counters["stats"]["unique_graphs"] - before == graphs
    assert out["steps"] == 3 and out["tokens_seen"] == 3 * batch_size * SEQ
    assert [m["batch_size"] for m in metrics(tmp_path / "out")] == [batch_size] * 3
    eager = pretrain.run(config, {"pack": pack}, tmp_path / "eager", make_ctx())
    assert eager["final_loss"] == pytest.approx(out["final_loss"], rel=1e-4)
    trained, expected = (
        load_file(tmp_path / "out" / "params.safetensors"),
        load_file(tmp_path / "eager" / "params.safetensors"),
    )
    assert trained.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=1e-4, atol=1e-5)


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    pack, tmp_path, make_ctx, monkeypatch
):
    from cram import model

    real = model.make_accumulate_step

    def diverging_at_step_3(*args, **kw):  # two microbatches a step: accumulate + apply
        accumulate, calls = real(*args, **kw), []

        def step(params, grads, batch):
            grads, out = accumulate(params, grads, batch)
            calls.append(1)
            if len(calls) == 5:  # the first microbatch of step 3
                grads = {k: g * float("nan") for k, g in grads.items()}
                out = {**out, "loss": out["loss"] * float("nan")}
            return grads, out

        return step

    monkeypatch.setattr(model, "make_accumulate_step", diverging_at_step_3)
    config = small(log_every_steps=2, checkpoint_every_steps=1, keep_checkpoints=5, batch_size=16)
    with pytest.raises(hooks.DivergedError, match=r"not finite at step 3; last good checkpoint: .*step-2"):
        pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert not (tmp_path / "out" / "params.safetensors").exists()


def test_bad_config_and_data_are_stage_errors(pack, tmp_path, make_ctx):
    with pytest.raises(StageError, match="pretrain.model.preset: 'huge'"):
        pretrain.run(small(model=pretrain.Architecture(preset="huge")), {"pack": pack}, tmp_path / "a", make_ctx())
    with pytest.raises(StageError, match="pretrain.schedule: 'linear'"):
        pretrain.run(small(schedule="linear"), {"pack": pack}, tmp_path / "b", make_ctx())
    with pytest.raises(StageError, match=r"multiple of microbatch x ranks \(16\)"):
        pretrain.run(small(batch_size=24), {"pack": pack}, tmp_path / "c", make_ctx(world_size=2))
    np.save(pack.path("val"), np.zeros((4, SEQ + 1), dtype=np.uint16))
    with pytest.raises(StageError, match=r"val.npy: shape \(4, 33\)"):
        pretrain.run(small(), {"pack": pack}, tmp_path / "d", make_ctx())


def test_run_attention_reaches_the_steps_and_trains_alike(pack, tmp_path, make_ctx, monkeypatch):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: (calls.append(1), sdpa(*a, **k))[1]
    )
    config = small(document_attention=True, val_blocks=0)
    pack.outputs["boundary"] = "cls-sep"
    written = pretrain.run(config, {"pack": pack}, tmp_path / "written", make_ctx(attention="auto"))
    assert calls == []  # on a CPU, "auto" is the written-out product
    chosen = pretrain.run(config, {"pack": pack}, tmp_path / "sdpa", make_ctx(attention="sdpa"))
    assert calls  # `[run] attention` reached the model
    assert chosen["final_loss"] == pytest.approx(written["final_loss"], rel=1e-5)


def test_a_zero_budget_takes_no_step_and_writes_the_model_it_starts_from(pack, tmp_path, make_ctx):
    from cram import model

    assert pretrain.Budget(hours=0, steps=0) == pretrain.Budget(tokens=0) and pretrain.Budget(tokens=0).tokens == 0
    assert pretrain.Budget(steps=0, tokens=5).tokens == 5
    config = small(budget=pretrain.Budget(tokens=0), compile=True)
    out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert out["steps"] == 0 and out["tokens_seen"] == 0 and out["compile_s"] == 0
    assert out["val_loss_start"] == out["val_loss_end"]
    fresh = model.init(model.ModelConfig.from_json(tmp_path / "out" / "model.json"), seed=0)
    written = load_file(tmp_path / "out" / "params.safetensors")
    assert written.keys() == fresh.keys() and all(torch.equal(written[k], fresh[k]) for k in fresh)


def load_pretrain(tmp_path, toml: str, *overrides: str) -> pretrain.Config:
    """The pretrain section of a pipeline file, as `cram run` reads it."""
    from cram.pipeline.config import load

    path = tmp_path / "pipeline.toml"
    path.write_text(toml)
    return load(path, {"pretrain": pretrain.Config}, list(overrides)).stages["pretrain"]


def test_a_steps_or_tokens_budget_from_toml_has_no_hidden_time_limit(tmp_path):
    for limit in ("steps = 100000", "tokens = 1_000_000_000"):
        budget = load_pretrain(tmp_path, f"[pretrain.budget]\n{limit}\n").budget
        assert budget.hours is None
        ten_hours = 36000.0
        assert budget_progress(budget, TrainState(seed=0, step=1, tokens_seen=128), ten_hours) < 1
    # No limit at all: the 3.5-minute default; 0 drops a limit the file sets (as a replay needs).
    assert load_pretrain(tmp_path, "[pretrain]\n").budget == pretrain.Budget(hours=pretrain.DEFAULT_HOURS)
    replay = load_pretrain(
        tmp_path, "[pretrain.budget]\nhours = 24.0\n", "pretrain.budget.hours=0", "pretrain.budget.tokens=5000"
    )
    assert replay.budget == pretrain.Budget(tokens=5000) and replay.budget.hours is None


def test_checkpoint_every_minutes_switches_off_from_toml(tmp_path, pack, make_ctx):
    from cram.pipeline.config import ConfigError

    config = load_pretrain(tmp_path, "[pretrain]\ncheckpoint_every_minutes = 0\n")
    assert config.checkpoint_every_minutes == 0
    assert not hooks.Checkpointing.of(config).due(step=10**6, last_saved_at=time.perf_counter() - 10**6)
    on = load_pretrain(tmp_path, "[pretrain]\ncheckpoint_every_minutes = 0.0001\n")
    assert hooks.Checkpointing.of(on).due(step=1, last_saved_at=time.perf_counter() - 1)
    with pytest.raises(ConfigError, match="checkpoint_every_minutes: -1.0 must be > 0, or 0 for off"):
        load_pretrain(tmp_path, "[pretrain]\ncheckpoint_every_minutes = -1.0\n")
    with pytest.raises(ConfigError, match="hours: -1.0 must be > 0, or 0 for no hours limit"):
        load_pretrain(tmp_path, "[pretrain.budget]\nhours = -1.0\n")
    # Off for real: a run writes only the final checkpoint however long it takes.
    run_config = small(checkpoint_every_minutes=0, budget=pretrain.Budget(steps=3))
    pretrain.run(run_config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-3"]


# --- real processes: SIGKILL and resume, 2-rank data parallelism ---------------------------------

WORKER = textwrap.dedent(
    """
    import os, pickle, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import structlog
    import cram.stages.shared.masking, cram.stages.pretraining.checkpoint
    from cram.stages import Context, pretrain
    job = pickle.loads(Path(sys.argv[1]).read_bytes())

    def hang_on_call(module, name, n):
        # Block on the n-th call, after telling the test where we are: it then kills us.
        real, calls = getattr(module, name), []
        def wrapper(*args, **kw):
            calls.append(1)
            if len(calls) == n:
                Path(job["out_dir"], "hanging").touch()
                time.sleep(600)
            return real(*args, **kw)
        setattr(module, name, wrapper)

    if "hang" in job:
        modules = {"mask_tokens": cram.stages.shared.masking, "write_tensors": cram.stages.pretraining.checkpoint}
        module = modules[job["hang"][0]]
        hang_on_call(module, *job["hang"])
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    ctx = Context(seed=0, device="cpu", run_dir=Path(job["out_dir"]).parent, log=structlog.get_logger(),
                  rank=rank, world_size=world_size)
    pretrain.run(job["config"], job["inputs"], Path(job["out_dir"]), ctx)
    if world_size > 1:
        dist.barrier()  # as the CLI does (the runner's barrier ends every stage), then tear down
        dist.destroy_process_group()
    """
)


def start_worker(tmp_path: Path, job: dict, env: dict | None = None) -> subprocess.Popen:
    (tmp_path / "worker.py").write_text(WORKER)
    job_file = tmp_path / f"job-{time.monotonic_ns()}.pkl"
    job_file.write_bytes(pickle.dumps(job))
    return subprocess.Popen(
        [sys.executable, str(tmp_path / "worker.py"), str(job_file), str(REPO)],
        # As many threads as this process: a thread count changes how float sums are split.
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def run_on_two_ranks(tmp_path: Path, job: dict, port: int) -> None:
    """`pretrain.run` of `job` on two gloo ranks (WORKER), to the end; fails with a rank's stderr."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [start_worker(tmp_path, job, {**env, "RANK": str(rank)}) for rank in (0, 1)]
    for proc in procs:
        assert proc.wait(timeout=180) == 0, proc.stderr.read().decode()[-3000:]


def kill_when_hanging(proc: subprocess.Popen, out_dir: Path) -> None:
    marker = out_dir / "hanging"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the worker never reached its hang point"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    marker.unlink()


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(pack, tmp_path, make_ctx):
    config = small(
        budget=pretrain.Budget(steps=10),
        batch_size=16,
        ramp=0.5,
        compile=True,
        backend="aot_eager",
        log_every_steps=3,
        checkpoint_every_steps=2,
    )
    straight = pretrain.run(config, {"pack": pack}, tmp_path / "straight", make_ctx())

    out_dir = tmp_path / "killed"
    job = {"config": config, "inputs": {"pack": pack}, "out_dir": str(out_dir)}
    # First kill: while writing the checkpoint of step 4 (step 2's is complete; one file of step 4's is).
    kill_when_hanging(start_worker(tmp_path, {**job, "hang": ("write_tensors", 4)}), out_dir)
    assert [p.name for p in (out_dir / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-2"]
    # Second kill: in step 8, after a resume from step 2 and a checkpoint at step 6. The 16th
    # masking is step 8's second microbatch (1 for compiling, 4 for the canary's 2 steps compiled and
    # eager, then 1 + 2 + 2 + 2 + 2 + 2).
    kill_when_hanging(start_worker(tmp_path, {**job, "hang": ("mask_tokens", 16)}), out_dir)
    assert checkpoint.latest(out_dir / "checkpoints").name == "step-6"
    resumed = pretrain.run(config, {"pack": pack}, out_dir, make_ctx())

    assert same_tensors(out_dir / "params.safetensors", tmp_path / "straight" / "params.safetensors")
    assert same_tensors(
        out_dir / "checkpoints" / "step-10" / checkpoint.OPTIMIZER,
        tmp_path / "straight" / "checkpoints" / "step-10" / checkpoint.OPTIMIZER,
    )
    curve = [(m["step"], m["loss"], m["batch_size"]) for m in metrics(out_dir)]
    assert curve == [(m["step"], m["loss"], m["batch_size"]) for m in metrics(tmp_path / "straight")]
    for key in ("steps", "tokens_seen", "final_loss", "loss_start", "val_loss_start", "val_loss_end"):
        assert resumed[key] == straight[key], key


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process_on_the_same_global_batch(pack, tmp_path, make_ctx, free_port):
    # 2 ranks x microbatch 8 and 1 rank x 2 accumulated microbatches of 8 see the same sequences,
    # masked alike; only the order of summing the gradients differs.
    config = small(batch_size=16, budget=pretrain.Budget(steps=4), compile=True, backend="aot_eager")
    alone = pretrain.run(config, {"pack": pack}, tmp_path / "alone", make_ctx())

    out_dir = tmp_path / "ranks"
    run_on_two_ranks(tmp_path, {"config": config, "inputs": {"pack": pack}, "out_dir": str(out_dir)}, free_port())

    ranks, one = load_file(out_dir / "params.safetensors"), load_file(tmp_path / "alone" / "params.safetensors")
    for name in one:
        torch.testing.assert_close(ranks[name], one[name], rtol=1e-5, atol=1e-6)
    losses = [m["loss"] for m in metrics(out_dir)]
    assert losses == pytest.approx([m["loss"] for m in metrics(tmp_path / "alone")], rel=1e-5)
    assert [m["batch_size"] for m in metrics(out_dir)] == [16] * 4
    assert alone["tokens_seen"] == 4 * 16 * SEQ


@pytest.mark.slow
def test_two_gloo_ranks_on_a_time_budget_agree_when_to_stop(pack, tmp_path, free_port):
    # The clock is agreed every 4 steps and extrapolated alike in between: both ranks take the same
    # steps (a rank stepping alone would hang in the gradient all-reduce) and end.
    config = small(batch_size=16, budget=pretrain.Budget(hours=2 / 3600), clock_sync_every_steps=4)
    out_dir = tmp_path / "ranks"
    run_on_two_ranks(tmp_path, {"config": config, "inputs": {"pack": pack}, "out_dir": str(out_dir)}, free_port())
    assert metrics(out_dir)[-1]["progress"] >= 1.0


def test_compile_canary_passes_a_sound_step_and_stops_a_miscompiled_one(pack, tmp_path, make_ctx, monkeypatch):
    from cram import model

    config = small(budget=pretrain.Budget(steps=2), compile=True, backend="aot_eager")
    out = pretrain.run(config, {"pack": pack}, tmp_path / "sound", make_ctx())
    assert out["canary_diff"] is not None and out["canary_diff"] < 1e-4

    real = model.make_train_step

    def miscompiled(cfg, opt_cfg, how, **kw):
        step = real(cfg, opt_cfg, how, **kw)
        if not how.compile:
            return step

        def wrong(params, opt_state, batch, lr):  # a numerics bug: the loss comes out 5% high
            params, opt_state, m = step(params, opt_state, batch, lr)
            return params, opt_state, {**m, "loss": m["loss"] * 1.05}

        return wrong

    monkeypatch.setattr(model, "make_train_step", miscompiled)
    with pytest.raises(CanaryError, match=r"compile canary: .* differs from eager by 0\.05 .*nothing was"):
        pretrain.run(config, {"pack": pack}, tmp_path / "broken", make_ctx())
    assert not (tmp_path / "broken" / "checkpoints").exists()
    # Off: trains anyway.
    off = pretrain.run(dataclasses.replace(config, canary_steps=0), {"pack": pack}, tmp_path / "off", make_ctx())
    assert off["canary_diff"] is None and off["steps"] == 2


@pytest.fixture
def native_bf16(monkeypatch):
    """This CPU multiplies bf16 natively, whatever the machine running the test has."""
    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: True)


@pytest.mark.usefixtures("native_bf16")
@pytest.mark.parametrize("also_at_256, chosen", [(False, "bf16"), (True, "fp32")])
def test_auto_precision_falls_back_from_a_wrong_bf16_step_says_so_and_trains(
    pack, tmp_path, make_ctx, monkeypatch, also_at_256, chosen
):
    from cram import model

    monkeypatch.setattr(model, "make_train_step", wrong_in_bf16(model.make_train_step, also_at_256))
    config = small(budget=pretrain.Budget(steps=2), compile=True, backend="inductor", precision="auto")
    with capture_logs() as logs:
        out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert out["steps"] == 2 and np.isfinite(out["final_loss"])
    assert out["precision"] == chosen and out["canary_diff"] < 1e-4
    assert out["precision_reason"].startswith("the compiled step differs from eager beyond canary_tolerance 0.02")
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1 and warned[0].endswith(
        f"computing in {chosen}" + ("" if also_at_256 else " with 256-bit vector code")
    )
    tried = [e["precision"] for e in logs if e["event"] == "canary"]
    assert tried == ["bf16", "bf16 with 256-bit vector code"] + (["fp32"] if also_at_256 else [])


@pytest.mark.usefixtures("native_bf16")
def test_explicit_bf16_is_never_changed_to_fp32_it_stops_before_training(pack, tmp_path, make_ctx, monkeypatch):
    from cram import model

    monkeypatch.setattr(model, "make_train_step", wrong_in_bf16(model.make_train_step, also_at_256=True))
    config = small(budget=pretrain.Budget(steps=2), compile=True, backend="inductor", precision="bf16")
    with pytest.raises(CanaryError, match=r"by inf in bf16, by inf in bf16 with 256-bit vector code .*nothing was"):
        pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.usefixtures("native_bf16")
def test_eager_steps_record_an_unchecked_precision(pack, tmp_path, make_ctx):
    config = small(budget=pretrain.Budget(steps=1), precision="auto")
    out = pretrain.run(config, {"pack": pack}, tmp_path / "eager", make_ctx())
    assert out["precision"] == "bf16" and out["canary_diff"] is None
    assert out["precision_reason"] == "auto: bf16, which this CPU multiplies natively; eager steps: no compile canary"


def test_model_section_offers_every_architecture_field_and_checks_types(tmp_path):
    from cram.model import ModelConfig
    from cram.pipeline.config import ConfigError

    fields = {f.name for f in dataclasses.fields(pretrain.Architecture)}
    assert fields == {"preset"} | {f.name for f in dataclasses.fields(ModelConfig)} - {
        "vocab_size",
        "max_seq_len",
        "pad_id",
        "dropout",
        "pooler",  # only a checkpoint brings one
    }
    config = load_pretrain(tmp_path, '[pretrain.model]\npreset = "small"\nposition = "rope"\nglu = false\n')
    assert (config.model.preset, config.model.position, config.model.glu, config.model.hidden) == (
        "small",
        "rope",
        False,
        None,
    )
    with pytest.raises(ConfigError, match="pretrain.model.position: expected .* got 'bogus'"):
        load_pretrain(tmp_path, '[pretrain.model]\nposition = "bogus"\n')


def test_auto_precision_is_bf16_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    from cram.stages.shared import device as devices

    cpu = torch.device("cpu")
    for avx512_bf16, amx, expected in (
        (True, False, torch.bfloat16),
        (False, True, torch.bfloat16),
        (False, False, None),
    ):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert devices.autocast_dtype("auto", cpu) is expected
        assert devices.autocast_dtype("fp32", cpu) is None
        assert devices.autocast_dtype("bf16", cpu) is torch.bfloat16
