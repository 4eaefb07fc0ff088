"""The token-classification head and its compiled steps (model/tagger.py): one graph per shape, equal to
eager, the ignored positions outside the loss, a toy task learned, and the tagger as each family's
...ForTokenClassification with logits equal to cram's."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from cram import model
from cram.model.tagger import (
    IGNORE,
    init_tag_head,
    make_tag_eval_step,
    make_tag_step,
    tag,
    tag_head_of,
    tag_loss,
    tagger_to_transformers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = model.ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=32)
OPT = model.AdamW(eps=1e-6, weight_decay=0.0, clip_norm=0.0)


def toy_batch(rows: int = 8, length: int = 12, seed: int = 0) -> dict:
    """Tag = token mod 3 at every other position, the rest ignored: learnable in a few dozen steps."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 64, (rows, length), generator=gen)
    labels = ids % 3
    labels[:, ::2] = IGNORE
    return {"input_ids": ids, "attention_mask": torch.ones(rows, length, dtype=torch.bool), "labels": labels}


def test_compiled_steps_are_one_graph_each_and_match_eager(head="linear"):
    """The linear head here; ModernBERT's runs compiled in the canary's test below."""
    params = {**model.init(CFG, 0), **init_tag_head(CFG, 3, 1, head)}
    eager = make_tag_step(CFG, OPT, model.EAGER, head=head)
    compiled = make_tag_step(CFG, OPT, model.Compilation(backend="aot_eager"), head=head)
    predict = make_tag_eval_step(CFG, model.Compilation(backend="aot_eager"), head=head)
    before = counters["stats"]["unique_graphs"]
    expected = got = (params, model.optimizer_init(OPT, params))
    for seed, lr in enumerate([1e-3, 5e-4, 2e-4]):  # new params, batches and lrs are inputs: no recompile
        batch = {**toy_batch(seed=seed), "dropout": torch.tensor(0.0)}
        *expected, expected_metrics = eager(*expected, batch, torch.tensor(lr))
        *got, metrics = compiled(*got, batch, torch.tensor(lr))
    logits = predict(got[0], batch)
    predict(got[0], toy_batch(seed=5))
    assert counters["stats"]["unique_graphs"] - before == 2
    torch.testing.assert_close(metrics, expected_metrics)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(logits, tag(expected[0], CFG, batch, head=head))
    assert logits.shape == (8, 12, 3) and logits.dtype == torch.float32


def test_the_loss_reads_the_tagged_positions_alone():
    logits = torch.randn(2, 5, 4)
    labels = torch.full((2, 5), IGNORE)
    labels[0, 1], labels[1, 3] = 2, 0
    expected = F.cross_entropy(torch.stack([logits[0, 1], logits[1, 3]]), torch.tensor([2, 0]))
    torch.testing.assert_close(tag_loss(logits, labels), expected)
    changed = logits.clone()
    changed[0, 0] += 10  # an ignored position changes nothing
    torch.testing.assert_close(tag_loss(changed, labels), expected)
    assert tag_loss(logits, torch.full((2, 5), IGNORE)) == 0


def test_the_step_learns_a_toy_task():
    params = {**model.init(CFG, 0), **init_tag_head(CFG, 3, 1)}
    step = make_tag_step(CFG, dataclasses.replace(OPT, lr=3e-3), model.EAGER)
    state, batch = (params, model.optimizer_init(OPT, params)), toy_batch(rows=16)
    first = None
    for _ in range(60):
        *state, metrics = step(*state, {**batch, "dropout": torch.tensor(0.0)}, torch.tensor(3e-3))
        first = first if first is not None else float(metrics["loss"])
    assert float(metrics["loss"]) < 0.3 * first


def families():
    from test_classifier_export import FAMILIES

    return FAMILIES


@pytest.mark.parametrize("family", ["modernbert", "bert", "roberta", "bert with a pooler"])
def test_a_tagger_exports_as_its_familys_token_classifier_with_equal_logits(family):
    """A checkpoint's pooler (BERT's, kept through pretraining) is no part of the token classifier: left out."""
    transformers = pytest.importorskip("transformers")
    pooler = family.endswith("pooler")
    cfg = dataclasses.replace(families()[family.split()[0]], pooler=pooler)
    head = tag_head_of(cfg)
    assert head == ("modernbert" if family == "modernbert" else "linear")
    assert ("pooler.dense.weight" in model.init(cfg, 0)) == pooler
    encoder = {k: v * 10 if v.ndim == 2 else v + 0.1 * torch.randn_like(v) for k, v in model.init(cfg, 0).items()}
    params = {k: v for k, v in encoder.items() if not k.startswith("head.")}
    params.update({k: v * 20 if v.ndim == 2 else v + 0.1 for k, v in init_tag_head(cfg, 5, 1, head).items()})
    labels = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    config, state = tagger_to_transformers(cfg, params, {"cls": 2, "sep": 3, "pad": 0}, labels)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf = getattr(transformers, config["architectures"][0])(hf_config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k]
    assert hf.config.id2label == dict(enumerate(labels))
    ids = torch.randint(5, cfg.vocab_size, (3, cfg.max_seq_len))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 9:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
    ours = tag(params, cfg, {"input_ids": ids, "attention_mask": mask}, head=head)
    assert expected.abs().max() > 0.1
    assert (ours - expected)[mask].abs().max().item() <= 1e-4


def test_the_taggers_canary_checks_each_compiled_graph_against_eager_and_predicts_what_eager_does(tmp_path):
    """The wing's fine-tuner (stages/tagging/tuning.py): a graph per (step or prediction, bucket), each within the
    canary's tolerance of eager; a compiled fine-tune tags every word as the eager one does."""
    import numpy as np
    from test_export import MODERNBERT  # ModernBERT's layout: its own head, compiled here

    from cram.stages import evaluate
    from cram.stages.shared.precision import FP32
    from cram.stages.tagging.kind import Taggers
    from cram.stages.tagging.tuning import TaggedSplits, Tagger, tag_graphs
    from cram.stages.tagging.windows import windowed
    from cram.stages.tasks.kind import Start

    special = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 9) for _ in range(12)]
    words = [[[int(t)] for t in rng.integers(5, 64, n)] for n in lengths]
    tags = [list(rng.integers(0, 3, n)) for n in lengths]
    rows = windowed([w for s in words for w in s], lengths, tags, special, max_length=8)
    config = evaluate.Config(
        tasks=[],
        batch_size=4,
        max_length=8,
        dropout=0.0,
        eval_batch_size=4,
        buckets=(8,),
        compile=True,
        backend="aot_eager",
    )
    tuning = config.tuning()
    start = Start(tuning, MODERNBERT, model.init(MODERNBERT, 0), special, torch.device("cpu"), "auto", 0, tmp_path)
    shapes = tag_graphs([TaggedSplits(3, rows, 1, [0], rows)], tuning)
    steps = sorted(g.packed_rows for g in shapes if not g.prediction)
    assert {g.length for g in shapes} == {8} and len(steps) == len(shapes) - 1 and steps[0] >= 1
    taggers = Taggers(start, shapes)
    assert (
        tag_head_of(MODERNBERT) == "modernbert"
        and taggers.graphs() == len(shapes)
        and taggers.canary(FP32, steps=2, tolerance=1e-4).value <= 1e-4
    )
    compiled, eager = taggers.tagger(FP32), Tagger.make(start, FP32, compile=False)
    results = []
    for tagger in (compiled, eager):
        params, loss = tagger.train(3, rows, (1, 1e-3, 0), "t", None)
        results.append((tagger.tags(params, rows)[0], loss))
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-4)
    assert all((a == b).all() for a, b in zip(results[0][0], results[1][0]))
    assert [len(t) for t in results[0][0]] == lengths  # every word tagged once
