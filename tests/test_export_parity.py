"""An exported classifier predicts as cram does: each family's transformers folder, run through
transformers' own `pipeline("text-classification")` on single texts, pairs and texts past the task's
max_length, gives `cram predict`'s labels and probabilities (1e-4)."""

import dataclasses
import json

import pytest
from test_classifier_export import FAMILIES, LABELS, sp_model, with_classifier  # noqa: F401 (a fixture)
from test_export import BERT, fake_run

from cram.pipeline.commands import predict
from cram.pipeline.commands.export import export
from cram.stages.kept.predicting import Settings
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)  # past max_length in any tokenizer here
FIRSTS = ["The cat sat on the mat.", "a", LONG, "Numbers like 1,234.5", LONG, LONG]
SECONDS = ["A dog.", LONG, "b", LONG, "The cat sat on the mat.", LONG + " again"]
# 13: a pair's budget (13 - 3 special tokens) is even; an odd one, where the longer text takes the extra
# token: `test_an_odd_budget_cuts_a_long_pair_as_the_fast_tokenizer_does`.
MAX_LENGTH = 13


def cram_rows(folder, texts, tmp_path):
    out = tmp_path / "rows.jsonl"
    predict.predict(folder, [texts], out=out, settings=Settings(compile=False, batch_size=2))
    return [json.loads(line) for line in out.read_text().splitlines()]


def assert_same(theirs, ours):
    for got, row in zip(theirs, ours, strict=True):
        probabilities = {r["label"]: r["score"] for r in got}
        assert max(probabilities, key=probabilities.get) == row["label"]
        assert max(abs(probabilities[n] - p) for n, p in row["probabilities"].items()) < 1e-4, (got, row)


@pytest.mark.parametrize(
    "family, head, pooling",
    [
        ("bert", "bert", "first"),
        ("bert", "bert", "pooler"),  # BERT's own pooler fine-tuned: maps exactly, so it exports
        ("modernbert", "modernbert", "mean"),
        ("roberta", "roberta", "first"),
    ],
)
@pytest.mark.parametrize("fields", [("text",), ("a", "b")])
def test_the_exported_classifier_predicts_as_cram_does(tmp_path, sp_model, family, head, pooling, fields):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(FAMILIES[family], pooler=pooling == "pooler")
    run, _ = fake_run(tmp_path, sp_model, cfg=cfg)
    with_classifier(run, cfg, head, pooling, text_fields=fields, max_length=MAX_LENGTH, buckets=(8, 16))
    hf = export(run, tmp_path / "hf", fmt="transformers", task="t")
    mine = export(run, tmp_path / "cram", task="t")
    texts = tmp_path / "texts.jsonl"
    records = [dict(zip(fields, pair)) for pair in zip(FIRSTS, SECONDS)]
    texts.write_text("".join(json.dumps(r) + "\n" for r in records))

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert tokenizer.model_max_length == MAX_LENGTH  # the task's, not the model's 24 positions
    assert ("token_type_ids" in tokenizer.model_input_names) == (cfg.token_types > 1)
    classify = transformers.pipeline("text-classification", model=str(hf), tokenizer=tokenizer, device="cpu")
    inputs = FIRSTS if len(fields) == 1 else [{"text": a, "text_pair": b} for a, b in zip(FIRSTS, SECONDS)]
    theirs = classify(inputs, top_k=None, truncation=True)
    assert_same(theirs, cram_rows(mine, texts, tmp_path))
    assert sorted(r["label"] for r in theirs[0]) == sorted(LABELS)


def test_a_pair_is_segment_1_after_the_first_separator_in_the_exported_tokenizer(tmp_path, sp_model):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    run, _ = fake_run(tmp_path, sp_model, cfg=BERT)
    with_classifier(run, BERT, "bert", text_fields=("a", "b"), max_length=MAX_LENGTH, buckets=(8, 16))
    tokenizer = transformers.AutoTokenizer.from_pretrained(export(run, tmp_path / "hf", fmt="transformers", task="t"))
    encoded = tokenizer("a cat", "a dog sat")
    ids, types = encoded["input_ids"], encoded["token_type_ids"]
    first_sep = ids.index(tokenizer.sep_token_id)
    assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1) and ids[-1] == tokenizer.sep_token_id


def test_an_odd_budget_cuts_a_long_pair_as_the_fast_tokenizer_does(tmp_path, sp_model):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    from cram.stages.kept.batches import join
    from cram.stages.shared import tokenizer as tokenizers

    run, _ = fake_run(tmp_path, sp_model, cfg=BERT)
    with_classifier(run, BERT, "bert", text_fields=("a", "b"), max_length=12, buckets=(8, 12))
    tokenizer = transformers.AutoTokenizer.from_pretrained(export(run, tmp_path / "hf", fmt="transformers", task="t"))
    ours = tokenizers.load(sp_model)
    row = join((ours.encode([LONG])[0], ours.encode([LONG + " again"])[0]), SPECIAL_IDS, 12)
    assert tokenizer(LONG, LONG + " again", truncation=True)["input_ids"] == row.tolist()
