"""A kept tagger out of cram: `cram export --format transformers` writes the family's ...ForTokenClassification
with id2label, and transformers' token-classification pipeline on it finds the entities `cram predict` finds
(type, start, end, score), on a cased and an uncased WordPiece encoder and cram's own sentencepiece one, on
texts with odd whitespace, and on a text longer than the tagger's max_length."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from test_export import BERT, MODERNBERT, corpus, fake_run
from test_tagging_windows import wordpiece
from test_tokenizer import SENTENCES

from cram import model
from cram.model.tagger import init_tag_head, tag_head_of
from cram.pipeline.commands import predict
from cram.pipeline.commands.export import export
from cram.pipeline.schema import StageRecord
from cram.pipeline.store import write_marker
from cram.stages import Upstream, evaluate, tokenize
from cram.stages.evaluating import keeping
from cram.stages.kept.predicting import Settings
from cram.stages.shared.special import SPECIAL_IDS
from cram.stages.tagging.results import tagger_meta

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "f" * 64
LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
SEED = 1
TEXTS = [
    "Her Fish sat quietly on the sofa while it was raining.",
    "  the cat  sat on the mat  ",  # leading, double and trailing spaces
    "a dog\tsat\ton the rug\t",  # tabs
    "My Bird sat happily, often, on the CHAIR!",
    "x",
]
LONG = " ".join(["the cat sat quietly on the mat while it was sunny"] * 4)  # past max_length 16, within 64 positions


def with_tagger(run, cfg, max_length=64, context_free=False):
    """RUN with a done evaluate stage that kept a tagger of task `t`: an encoder (`context_free`: its attention
    and positions zeroed, so each token's tags depend on it alone) and a head scaled so that its tags vary."""
    gen = torch.Generator().manual_seed(SEED)  # its own draws: the tags are the same whatever ran before
    # init's small weights: each token's own embedding carries through the layers, so its tags vary
    params = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in model.init(cfg, seed=0).items()}
    if context_free:
        params.update({k: torch.zeros_like(v) for k, v in params.items() if ".attn.out." in k or "positions" in k})
    head = init_tag_head(cfg, len(LABELS), seed=0, head=tag_head_of(cfg))
    params.update(
        {k: v + torch.randn(v.shape, generator=gen) * (3 if k.endswith("out.weight") else 0.1) for k, v in head.items()}
    )
    params = {k: v for k, v in params.items() if not k.startswith("head.")}
    config = evaluate.Config(tasks=[], max_length=max_length, buckets=(max_length,))
    loaded = SimpleNamespace(
        task=SimpleNamespace(name="t"),
        config=SimpleNamespace(kind="token-classification"),
        data=SimpleNamespace(labels=tuple(LABELS)),
        settings=SimpleNamespace(max_length=max_length),
    )
    tokenizer = next(p.name for p in (run / "tokenize").iterdir())
    upstream = Upstream(run / "tokenize", {"tokenizer": tokenizer, "special_ids": SPECIAL_IDS})
    folder = run / "evaluate"
    folder.mkdir()
    meta = {0: tagger_meta(loaded, config.tuning(), keeping.tokenizer_fields(upstream))}
    keeper = keeping.Keeper("best", folder, run / "pretrain" / "model.json", meta)
    task = SimpleNamespace(name="t", metrics=("f1",), tests={"validation": None})
    keeper.offer(0, 0, task, params, {"scores": {"validation": {"f1": 0.5}}, "meta": {"head": tag_head_of(cfg)}})
    kept = keeper.finish([(0, 0)], {0: 0})
    record = {"status": "done", "key": KEY, "outputs": {"results": "results.json", "classifiers": kept}}
    write_marker(folder, "evaluate", KEY, StageRecord.from_json(record, "record"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["evaluate"] = record
    (run / "manifest.json").write_text(json.dumps(manifest))


def cram_entities(run, tmp_path, texts, task="t", settings=Settings(compile=False, batch_size=3)):
    inputs = tmp_path / "texts.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "entities.jsonl"
    assert predict.predict(run, [inputs], task=task, out=out, settings=settings) == len(texts)
    return [json.loads(line)["entities"] for line in out.read_text().splitlines()]


def pipeline_entities(folder, texts, strategy="first"):
    import transformers

    tagger = transformers.pipeline("token-classification", model=str(folder), aggregation_strategy=strategy)
    return [tagger(t) for t in texts]


def same(ours, theirs, text, trimmed_only=False):
    """cram's entities equal the pipeline's: type, start, end, the text they cover, and the score; the pipeline's
    spans without their outer whitespace (a byte-level or sentencepiece token's offsets begin with its space;
    a span of whitespace alone is none), which must change nothing unless `trimmed_only` allows it."""
    spans = []
    for e in theirs:
        piece = text[e["start"] : e["end"]]
        start, end = e["start"] + len(piece) - len(piece.lstrip()), e["end"] - len(piece) + len(piece.rstrip())
        assert trimmed_only or (start, end) == (e["start"], e["end"]), (text, e)
        if start < end:
            spans.append((e["entity_group"], start, end, float(e["score"])))
    assert [(e["type"], e["start"], e["end"]) for e in ours] == [s[:3] for s in spans], text
    assert all(e["text"] == text[e["start"] : e["end"]] == e["text"].strip() for e in ours)
    assert [e["score"] for e in ours] == pytest.approx([s[3] for s in spans], abs=1e-4)


def byte_level(folder):
    """A byte-level BPE tokenizer (RoBERTa's pre-tokenizer: a word's space is its first byte) with cram's special
    ids, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=200, special_tokens=specials))
    names = dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    sp = root / "sp" / "tokenizer.model"
    sp.parent.mkdir()
    sp.write_bytes(tokenize.train_tokenizer(corpus(), tokenize.Config(vocab_size=MODERNBERT.vocab_size)))
    return {
        "cased": wordpiece(root / "cased") / "tokenizer.json",
        "uncased": wordpiece(root / "uncased", lowercase=True) / "tokenizer.json",
        "sentencepiece": sp,
        "bytelevel": byte_level(root / "bytelevel") / "tokenizer.json",
    }


@pytest.mark.parametrize(
    ("encoder", "family"),
    [("cased", "bert"), ("uncased", "bert"), ("sentencepiece", "modernbert"), ("bytelevel", "bert")],
)
def test_the_export_is_a_token_classifier_whose_pipeline_finds_cram_predicts_entities(
    tmp_path, encoders, encoder, family
):
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(BERT if family == "bert" else MODERNBERT, max_seq_len=64)
    run, _ = fake_run(tmp_path, encoders[encoder], cfg=cfg)
    with_tagger(run, cfg)
    folder = export(run, tmp_path / "hf", fmt="transformers", task="t")
    hf = transformers.AutoModelForTokenClassification.from_pretrained(folder)
    assert type(hf).__name__ == (
        "BertForTokenClassification" if family == "bert" else "ModernBertForTokenClassification"
    )
    assert hf.config.id2label == dict(enumerate(LABELS)) and hf.config.label2id == {n: i for i, n in enumerate(LABELS)}
    ours, theirs = cram_entities(run, tmp_path, TEXTS), pipeline_entities(folder, TEXTS)
    assert sum(map(len, ours)) >= 5  # entities to compare, not empty lists
    for text, o, t in zip(TEXTS, ours, theirs):
        same(o, t, text, trimmed_only=encoder in ("sentencepiece", "bytelevel"))
    # the cram-format export predicts what the run does
    assert cram_entities(export(run, tmp_path / "cram", task="t"), tmp_path, TEXTS, task=None) == ours


def test_simple_aggregation_agrees_where_every_word_is_one_token(tmp_path, encoders):
    """ "simple" reads each sub-token's own tag; a word's later sub-tokens are outside the fine-tune's loss, so
    it agrees with cram where no word has one (docs/tagging.md)."""
    cfg = dataclasses.replace(BERT, max_seq_len=64)
    run, _ = fake_run(tmp_path, encoders["uncased"], cfg=cfg)
    with_tagger(run, cfg)
    folder = export(run, tmp_path / "hf", fmt="transformers", task="t")
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
    candidates = "the cat sat on mat while it was sunny quietly happily often raining a my her rug dog".split()
    words = [w for w in candidates if len(fast.encode(w, add_special_tokens=False).tokens) == 1]
    assert len(words) >= 8
    whole = [" ".join(words), "  ".join(reversed(words)) + " ", "\t".join(words[::2])]
    for text, o, t in zip(whole, cram_entities(run, tmp_path, whole), pipeline_entities(folder, whole, "simple")):
        same(o, t, text)


def test_a_text_longer_than_max_length_is_windowed_and_every_word_tagged(tmp_path, encoders):
    """With each token's tags its own alone (attention and positions zeroed), the windows of cram predict and
    the pipeline's one pass over the whole text (within the model's positions) see the same: equal entities,
    none lost at a window's edge. A model that reads context tags a long text's words from other context than
    the pipeline's one pass (or its `stride` chunks, merged by entity length): docs/tagging.md."""
    cfg = dataclasses.replace(BERT, max_seq_len=64)
    run, _ = fake_run(tmp_path, encoders["cased"], cfg=cfg)
    with_tagger(run, cfg, max_length=16, context_free=True)
    folder = export(run, tmp_path / "hf", fmt="transformers", task="t")
    from tokenizers import Tokenizer

    assert len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(LONG).ids) > 3 * 16
    (ours,), (theirs,) = cram_entities(run, tmp_path, [LONG]), pipeline_entities(folder, [LONG])
    assert len(ours) >= 5 and max(e["end"] for e in ours) > len(LONG) // 2
    same(ours, theirs, LONG)
    # compiled (a graph per bucket), the windows tag as eagerly
    compiled = Settings(compile=True, backend="aot_eager", batch_size=3)
    assert cram_entities(run, tmp_path, [LONG, *TEXTS], settings=compiled)[0] == ours


def test_a_tagger_predicts_json_lines_alone(tmp_path, encoders):
    cfg = dataclasses.replace(BERT, max_seq_len=64)
    run, _ = fake_run(tmp_path, encoders["cased"], cfg=cfg)
    with_tagger(run, cfg)
    inputs = tmp_path / "texts.txt"
    inputs.write_text("the cat\n")
    with pytest.raises(predict.PredictError, match="a tagger writes each text's entities as JSON lines"):
        predict.predict(run, [inputs], task="t", out=tmp_path / "out.csv", settings=Settings(compile=False))
    assert not (tmp_path / "out.csv").exists()
