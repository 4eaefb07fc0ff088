"""Sequence-length phases, the masking-rate schedule and document ids: the stream across phases, exact
resume at and between phase changes, one graph per phase, the ignored rows of a schedule below its peak."""

import json
import shutil

import numpy as np
import pytest
import torch
from test_pretrain import SEQ, VOCAB, metrics, pack, same_tensors, small  # noqa: F401 (pack is a fixture)

from cram import model
from cram.pipeline import config as cfg
from cram.pipeline.planning import keyed_config
from cram.stages import StageError, Upstream, pretrain
from cram.stages.pretraining import phases
from cram.stages.pretraining.batches import Microbatch, read_sequences
from cram.stages.pretraining.phases import Phase, enter, plan
from cram.stages.pretraining.resolved import Batch, Resolved
from cram.stages.pretraining.setup import prepare
from cram.stages.pretraining.state import TrainState
from cram.stages.pretraining.steps import make_steps
from cram.stages.shared.blocks import Boundary, blocks_of, document_ids
from cram.stages.shared.masking import IGNORED, Masking, MaskSpec, mask_tokens
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

TWO_PHASES = (Phase(SEQ // 2, until=0.5), Phase(SEQ))


def test_phases_load_from_toml_and_stay_out_of_the_key_at_their_default(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(
        "[pretrain]\nphases = [{ seq_len = 128, until = 0.9 }, { seq_len = 512, microbatch = 8 }]\n"
        "[pretrain.masking]\nrate = 0.4\nend_rate = 0.2\n"
    )
    loaded = cfg.load(path, {"pretrain": pretrain.Config}).stages["pretrain"]
    assert loaded.phases == (Phase(128, until=0.9), Phase(512, microbatch=8))
    assert loaded.masking.end_rate == 0.2
    saved = tmp_path / "saved.toml"  # the resolved config a run writes reads back the same
    saved.write_text(cfg.to_toml({"pretrain": cfg.as_plain(loaded)}))
    assert cfg.load(saved, {"pretrain": pretrain.Config}).stages["pretrain"] == loaded
    keyed = keyed_config(pretrain, pretrain.Config())
    assert "phases" not in keyed and "end_rate" not in keyed["masking"] and "document_attention" not in keyed
    assert keyed_config(pretrain, loaded)["phases"] == [
        {"seq_len": 128, "until": 0.9, "microbatch": None},
        {"seq_len": 512, "until": None, "microbatch": 8},
    ]


def test_a_shorter_phase_reads_each_chunk_as_consecutive_pieces():
    train = np.arange(6 * 8, dtype=np.uint16).reshape(6, 8)  # pack's blocks of 8
    chunks = blocks_of(train, 16)
    assert chunks.shape == (3, 16) and np.array_equal(chunks.reshape(-1), train.reshape(-1)[:48])
    whole = read_sequences(chunks, seed=1, first=0, count=3, orders={})
    halves = read_sequences(chunks, seed=1, first=0, count=6, orders={}, pieces=2)
    assert np.array_equal(halves.reshape(3, 16), whole)
    # One phase at pack's length: the chunk is pack's block, the stream as it always was.
    assert np.array_equal(read_sequences(blocks_of(train, 8), 1, 2, 4, {}), read_sequences(train, 1, 2, 4, {}))


def test_a_phase_starts_at_the_chunk_boundary_after_the_last_token_read():
    phased = plan(small(phases=TWO_PHASES), SEQ, SPECIAL_IDS, VOCAB)
    state = TrainState(seed=0, sequences=3)  # 3 sequences of 16 read: 48 tokens, 1.5 chunks
    enter(phased, state, 0.4)
    assert (state.phase, state.sequences) == (0, 3)
    enter(phased, state, 0.5)
    assert (state.phase, state.phase_start, state.sequences) == (1, 64, 0)
    assert phased.first_sequence(state) == 2
    assert [s.microbatch for s in phased.spans] == [16, 8] and [s.batch_size for s in phased.spans] == [16, 8]


def test_two_phases_train_at_their_lengths_with_equal_tokens_per_step(pack, tmp_path, make_ctx):  # noqa: F811
    out = pretrain.run(small(phases=TWO_PHASES), {"pack": pack}, tmp_path / "out", make_ctx())
    rows = metrics(tmp_path / "out")
    assert [(m["batch_size"], m["seq_len"]) for m in rows] == [(16, 16)] * 3 + [(8, 32)] * 3
    assert out["tokens_seen"] == 6 * 8 * SEQ and out["seq_lens"] == [SEQ // 2, SEQ]
    cfg_json = json.loads((tmp_path / "out" / "model.json").read_text())
    assert cfg_json["max_seq_len"] == SEQ
    # Per-token FLOPs differ by phase: the total is each phase's count times its tokens.
    mcfg = model.ModelConfig(**cfg_json)
    short = model.flops_per_token(model.ModelConfig(**{**cfg_json, "max_seq_len": SEQ // 2}), 0.25)
    assert out["flops_seen"] == pytest.approx(3 * 8 * SEQ * (short + model.flops_per_token(mcfg, 0.25)))


@pytest.mark.parametrize("at", [2, 4], ids=["mid-phase", "at-the-change"])
def test_resume_mid_phase_or_at_the_change_is_bit_identical(pack, tmp_path, make_ctx, at):  # noqa: F811
    config = small(
        phases=TWO_PHASES,
        budget=pretrain.Budget(steps=8),
        checkpoint_every_steps=2,
        keep_checkpoints=4,
        masking=Masking(rate=0.3, end_rate=0.15),
    )
    pretrain.run(config, {"pack": pack}, tmp_path / "straight", make_ctx())
    resumed = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / f"step-{at}", resumed / f"step-{at}")
    pretrain.run(config, {"pack": pack}, tmp_path / "resumed", make_ctx())
    assert same_tensors(tmp_path / "straight" / "params.safetensors", tmp_path / "resumed" / "params.safetensors")
    curve = [[(m["step"], m["loss"], m["batch_size"]) for m in metrics(tmp_path / d)] for d in ("straight", "resumed")]
    assert curve[0][at:] == curve[1]


def test_each_phase_is_one_graph_compiled_before_the_clock(pack, tmp_path, make_ctx):  # noqa: F811
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    config = small(phases=TWO_PHASES, compile=True, backend="aot_eager", canary_steps=1)
    out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    # fullgraph=True: a break would raise; the recompile limit is the declared graph count.
    assert counters["stats"]["unique_graphs"] - before == 2 and out["steps"] == 6


def test_a_graph_beyond_the_declared_ones_fails_rather_than_falls_back_to_eager(pack, tmp_path, make_ctx, monkeypatch):  # noqa: F811
    monkeypatch.setattr(phases.Plan, "shapes", property(lambda self: 1))  # declare one graph too few
    config = small(phases=TWO_PHASES, compile=True, backend="aot_eager", canary_steps=0)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())


def test_a_schedule_below_its_peak_ignores_the_rows_above_the_rate():
    spec = MaskSpec(per_sequence=8, mask_id=4, vocab_size=VOCAB, special_ids=tuple(SPECIAL_IDS.values()))
    ids = torch.randint(5, VOCAB, (16, SEQ))
    full = mask_tokens(ids, spec, torch.Generator().manual_seed(0))
    part = mask_tokens(ids, MaskSpec(**{**spec.__dict__, "labelled": 3}), torch.Generator().manual_seed(0))
    assert torch.equal(part["mlm_positions"], full["mlm_positions"])  # shapes and positions as at the peak
    labelled = (part["mlm_labels"] != IGNORED).view(16, 8)
    assert (labelled.sum(1) == 3).all()
    ignored = part["mlm_positions"][part["mlm_labels"] == IGNORED]
    assert torch.equal(part["input_ids"].view(-1)[ignored], ids.view(-1)[ignored])  # they keep their token
    kept = part["mlm_labels"] != IGNORED
    assert torch.equal(part["mlm_labels"][kept], full["mlm_labels"][kept])
    # The loss and accuracy count the labelled rows alone.
    mcfg = model.ModelConfig(vocab_size=VOCAB, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=SEQ)
    params = model.init(mcfg, 0)
    loss, aux = model.mlm_loss(params, mcfg, part)
    only = {**part, "mlm_positions": part["mlm_positions"][kept], "mlm_labels": part["mlm_labels"][kept]}
    loss_only, aux_only = model.mlm_loss(params, mcfg, only)
    assert loss.item() == pytest.approx(loss_only.item(), rel=1e-5) and aux["accuracy"] == aux_only["accuracy"]


def test_the_schedule_masks_at_each_phases_peak_and_labels_the_current_rate():
    phased = plan(small(phases=TWO_PHASES, masking=Masking(rate=0.4, end_rate=0.2)), SEQ, SPECIAL_IDS, VOCAB)
    first, second = phased.spans
    assert first.spec.per_sequence == round(0.4 * 16) and second.spec.per_sequence == round(0.3 * 32)
    assert phased.spec_at(first, 0.0).labelled == 6 and phased.spec_at(second, 1.0).labelled == round(0.2 * 32)
    constant = plan(small(), SEQ, SPECIAL_IDS, VOCAB)
    assert constant.spec_at(constant.spans[0], 0.7).labelled is None  # no schedule: every row, as before


def test_a_rate_per_phase_masks_each_phase_at_its_own_static_count():
    three = (Phase(SEQ, until=0.5), Phase(SEQ, until=0.8), Phase(SEQ))  # one length: a schedule over progress
    phased = plan(small(phases=three, masking=Masking(phase_rates=(0.4, 0.25, 0.1))), SEQ, SPECIAL_IDS, VOCAB)
    assert [s.spec.per_sequence for s in phased.spans] == [round(0.4 * 32), round(0.25 * 32), round(0.1 * 32)]
    assert phased.shapes == 3  # each count its own graph, declared up front; no labelled subset
    assert all(phased.spec_at(s, s.start).labelled is None for s in phased.spans)
    assert phased.span_at(0.6).spec.per_sequence == 8
    with pytest.raises(StageError, match=r"pretrain.masking.phase_rates\[1\]: 0.01 masks no token of a 32"):
        plan(small(phases=TWO_PHASES, masking=Masking(phase_rates=(0.4, 0.01))), SEQ, SPECIAL_IDS, VOCAB)
    with pytest.raises(StageError, match="pretrain.masking.phase_rates: 3 rates for 2 phase"):
        plan(small(phases=TWO_PHASES, masking=Masking(phase_rates=(0.4, 0.3, 0.2))), SEQ, SPECIAL_IDS, VOCAB)
    with pytest.raises(ValueError, match="phase_rates, end_rate"):
        Masking(phase_rates=(0.3,), end_rate=0.2)


def test_all_mask_replaces_every_selected_token_by_mask():
    spec = MaskSpec(
        per_sequence=8,
        mask_id=4,
        vocab_size=VOCAB,
        special_ids=tuple(SPECIAL_IDS.values()),
        replace_with_mask=1.0,
        replace_with_random=0.0,
    )
    ids = torch.randint(5, VOCAB, (16, SEQ))
    batch = mask_tokens(ids, spec, torch.Generator().manual_seed(0))
    assert (batch["input_ids"].view(-1)[batch["mlm_positions"]] == 4).all()
    assert torch.equal(batch["mlm_labels"], ids.view(-1)[batch["mlm_positions"]])
    unchosen = torch.ones(16 * SEQ, dtype=torch.bool).index_fill(0, batch["mlm_positions"], False)
    assert torch.equal(batch["input_ids"].view(-1)[unchosen], ids.view(-1)[unchosen])
    # BERT's 80/10/10 on the same draw: some chosen rows keep their token or take a random one.
    bert = mask_tokens(
        ids,
        MaskSpec(**{**spec.__dict__, "replace_with_mask": 0.8, "replace_with_random": 0.1}),
        torch.Generator().manual_seed(0),
    )
    assert (bert["input_ids"].view(-1)[bert["mlm_positions"]] != 4).any()
    assert (
        plan(small(masking=Masking(mask_token=1.0, random_token=0.0)), SEQ, SPECIAL_IDS, VOCAB)
        .spans[0]
        .spec.replace_with_random
        == 0.0
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(phases=(Phase(16, until=0.5), Phase(32, until=0.9))), "pretrain.phases[1].until: 0.9; the last"),
        (dict(phases=(Phase(16), Phase(32))), "pretrain.phases[0].until: None; the phase needs until"),
        (
            dict(phases=(Phase(8, until=0.5), Phase(16, until=0.4), Phase(32))),
            "pretrain.phases[1].until: 0.4 must be above the previous phase's 0.5",
        ),
        (dict(phases=(Phase(12, until=0.5), Phase(32))), "pretrain.phases[0].seq_len: 12 must divide"),
        (dict(phases=(Phase(SEQ * 16),), microbatch=8, batch_size=8), "pretrain.phases[0].microbatch: 8 x 32 tokens"),
        (
            dict(phases=(Phase(16, until=0.5), Phase(32, microbatch=3))),
            "pretrain.phases[1].microbatch: 3 x 1 rank(s) must divide the phase's batch of 8",
        ),
        (dict(masking=Masking(rate=0.3, end_rate=0.01)), "pretrain.masking.end_rate: 0.01 masks no token of a 32"),
        (dict(phases=(Phase(2, until=0.5), Phase(32))), "pretrain.masking.rate: 0.25 masks no token of a 2-token"),
    ],
)
def test_phases_that_cannot_run_name_their_key(kw, message):
    with pytest.raises(StageError) as caught:
        plan(small(**kw), SEQ, SPECIAL_IDS, VOCAB)
    assert message in str(caught.value)


def test_document_ids_count_boundaries_of_the_unmasked_ids():
    cls, sep = SPECIAL_IDS["cls"], SPECIAL_IDS["sep"]
    ids = torch.tensor([[9, sep, cls, 7, 8, sep, cls, 9]])
    starts = document_ids(ids, Boundary(cls, starts=True))
    assert starts.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]] and starts.dtype == torch.int32
    ends = document_ids(torch.tensor([[9, sep, 7, 8, sep, 9]]), Boundary(sep, starts=False))
    assert ends.tolist() == [[0, 0, 1, 1, 1, 2]]


def test_a_batch_carries_document_ids_only_with_document_attention(pack, make_ctx):  # noqa: F811
    pack = Upstream(pack.dir, {**pack.outputs, "boundary": "cls-sep"})
    for on in (False, True):
        config = small(document_attention=on)
        setup = prepare(config, Batch.given(config), pack, make_ctx())
        steps = make_steps(Resolved(Batch.given(config), config.optimizer), setup, setup.compilation(False), 1)
        ids = torch.from_numpy(read_sequences(setup.blocks, 0, 0, 4, {}))
        ids[:, 5] = SPECIAL_IDS["cls"]
        batch = steps.batch(Microbatch(ids, 0, 1), setup.spec)
        assert ("document_ids" in batch) == on
        if on:
            assert torch.equal(batch["document_ids"], document_ids(ids.long(), setup.documents))


def test_the_compiled_step_with_document_ids_is_one_graph(pack, tmp_path, make_ctx):  # noqa: F811
    from torch._dynamo.utils import counters

    pack = Upstream(pack.dir, {**pack.outputs, "boundary": "cls-sep"})

    before = counters["stats"]["unique_graphs"]
    config = small(document_attention=True, compile=True, backend="aot_eager", budget=pretrain.Budget(steps=2))
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = pretrain.run(config, {"pack": pack}, tmp_path / "out", make_ctx())
    assert counters["stats"]["unique_graphs"] - before == 1 and out["steps"] == 2


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process_across_phases(pack, tmp_path, make_ctx, free_port):  # noqa: F811
    from safetensors.torch import load_file
    from test_pretrain import run_on_two_ranks

    config = small(phases=TWO_PHASES, batch_size=16, budget=pretrain.Budget(steps=4))
    pretrain.run(config, {"pack": pack}, tmp_path / "alone", make_ctx())
    out_dir = tmp_path / "ranks"
    run_on_two_ranks(tmp_path, {"config": config, "inputs": {"pack": pack}, "out_dir": str(out_dir)}, free_port())
    ranks, one = load_file(out_dir / "params.safetensors"), load_file(tmp_path / "alone" / "params.safetensors")
    for name in one:
        torch.testing.assert_close(ranks[name], one[name], rtol=1e-5, atol=1e-6)
    assert [m["batch_size"] for m in metrics(out_dir)] == [32, 32, 16, 16]
