"""Pair tasks read BERT's segments: what follows the first [SEP] is token type 1 wherever the model has a
type table, as transformers' tokenizers make it; `pooling = "pooler"` starts the head from the pooler."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_hf import BERT, perturbed

from cram import model
from cram.model.classifier import classify, init_head_params
from cram.model.hf import from_transformers
from cram.stages.evaluate import Config
from cram.stages.finetuning.finetune import Tuner, model_inputs
from cram.stages.shared.precision import candidates

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SPECIAL = {"pad": 0, "cls": 1, "sep": 2, "mask": 3, "unk": 4}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A random BertForSequenceClassification (two token types, a pooler), and cram's reading of it."""
    folder = tmp_path_factory.mktemp("bert-cls")
    hf = perturbed(transformers.BertForSequenceClassification(transformers.BertConfig(**BERT, num_labels=2)))
    hf.save_pretrained(folder)
    cfg, params = from_transformers(
        json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors"), "ckpt"
    )
    return hf, cfg, params


def tuner(cfg, params, pooling="first"):
    config = Config(tasks=[], compile=False, pooling=pooling, head_width=0, buckets=(16,), max_length=16, batch_size=3)
    return Tuner.make(
        config.tuning(),
        cfg,
        params,
        SPECIAL,
        torch.device("cpu"),
        candidates("fp32", torch.device("cpu"), "inductor", False)[0],
    )


def pair_rows():
    """[CLS] a [SEP] b [SEP] rows, one single text, of ids that are never special."""
    rows = [[1, 10, 11, 2, 20, 21, 22, 2], [1, 12, 2, 23, 2], [1, 13, 14, 15, 2]]
    return [np.asarray(r) for r in rows], np.array([len(r) for r in rows]), np.zeros(3, dtype=np.int64)


def test_a_pair_s_second_text_is_type_one_and_padding_and_single_texts_type_zero(bert):
    _, cfg, params = bert
    rows, lengths, labels = pair_rows()
    batch = tuner(cfg, params).batch(rows, lengths, labels, np.arange(3), 3)
    expected = [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0, 0], [0] * 8]  # eager: padded to the longest
    assert batch["token_type_ids"].tolist() == expected
    # RoBERTa's single-row table and models without one read no token types
    single = dataclasses.replace(cfg, token_types=1)
    assert "token_type_ids" not in tuner(single, params).batch(rows, lengths, labels, np.arange(3), 3)


def test_the_pair_encoding_equals_transformers_given_its_token_types_and_not_all_row_zero(bert):
    hf, cfg, params = bert
    rows, lengths, labels = pair_rows()
    batch = model_inputs(tuner(cfg, params).batch(rows, lengths, labels, np.arange(3), 3))
    with torch.no_grad():
        expected = hf.bert(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"].long(),
            token_type_ids=batch["token_type_ids"],
        ).last_hidden_state
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    ours = model.encode(params, cfg, ids, mask, token_type_ids=types)
    assert (ours[mask] - expected[mask]).abs().max().item() <= 1e-4
    row_zero = model.encode(params, cfg, ids, mask)
    assert (row_zero[0, 4:8] - expected[0, 4:8]).abs().max().item() > 1e-2
    assert torch.equal(row_zero, model.encode(params, cfg, ids, mask, token_type_ids=torch.zeros_like(types)))


def test_the_pooler_head_computes_bert_s_classifier_logits(bert):
    hf, cfg, params = bert
    pooled = tuner(cfg, params, pooling="pooler")
    head = pooled.head(2, seed=0)
    assert torch.equal(head["classifier.dense.weight"], params["pooler.dense.weight"])
    assert not torch.equal(
        tuner(cfg, params).head(2, seed=0)["classifier.dense.weight"], head["classifier.dense.weight"]
    )
    # With BERT's classifier as the output layer, cram's logits are transformers'.
    full = {
        **params,
        **head,
        "classifier.out.weight": hf.classifier.weight.detach(),
        "classifier.out.bias": hf.classifier.bias.detach(),
    }
    rows, lengths, labels = pair_rows()
    batch = model_inputs(pooled.batch(rows, lengths, labels, np.arange(3), 3))
    with torch.no_grad():
        expected = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"].long(),
            token_type_ids=batch["token_type_ids"],
        ).logits
    ours = classify(
        full, cfg, batch["input_ids"], batch["attention_mask"], "pooler", token_type_ids=batch["token_type_ids"]
    )
    assert (ours - expected).abs().max().item() <= 1e-4
    assert init_head_params(cfg, 2, 0, width=0).keys() == head.keys()
