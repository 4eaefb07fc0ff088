"""Every common encoder checkpoint loads (`model/hf.py`): base models with or without their prefix,
sequence classifiers and DistilBERT compute transformers' hidden states; what a checkpoint lacks (the
masked-LM head) is named, what it brings (BERT's pooler) kept, a family cram cannot compute refused."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_hf import BERT, MODERNBERT, ROBERTA, TINY, S, V, batch, perturbed

from cram import model
from cram.model.hf import UnsupportedCheckpoint, from_transformers, missing_head

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

DISTILBERT = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=S)
CLASSES = dict(num_labels=3)


def _t(name):
    return getattr(transformers, name)


BUILDERS = {
    "BertModel": lambda: _t("BertModel")(_t("BertConfig")(**BERT)),
    "RobertaModel": lambda: _t("RobertaModel")(_t("RobertaConfig")(**ROBERTA)),
    "XLMRobertaModel": lambda: _t("XLMRobertaModel")(_t("XLMRobertaConfig")(**ROBERTA)),
    "ModernBertModel": lambda: _t("ModernBertModel")(_t("ModernBertConfig")(**MODERNBERT)),
    "DistilBertModel": lambda: _t("DistilBertModel")(_t("DistilBertConfig")(**DISTILBERT)),
    "DistilBertForMaskedLM": lambda: _t("DistilBertForMaskedLM")(
        _t("DistilBertConfig")(**DISTILBERT, sinusoidal_pos_embds=True)
    ),
    "BertForSequenceClassification": lambda: _t("BertForSequenceClassification")(_t("BertConfig")(**BERT, **CLASSES)),
    "RobertaForSequenceClassification": lambda: _t("RobertaForSequenceClassification")(
        _t("RobertaConfig")(**ROBERTA, **CLASSES)
    ),
    "ModernBertForSequenceClassification": lambda: _t("ModernBertForSequenceClassification")(
        _t("ModernBertConfig")(**MODERNBERT, **CLASSES)
    ),
    "DistilBertForSequenceClassification": lambda: _t("DistilBertForSequenceClassification")(
        _t("DistilBertConfig")(**DISTILBERT, **CLASSES)
    ),
}
# Saved with their masked-LM head; the others are headless and give params without cram's head.
WITH_HEAD = {"DistilBertForMaskedLM"}
# BERT's pooler, kept: base models and BERT's classifier have one (RoBERTa's classifier has its own head).
WITH_POOLER = {"BertModel", "RobertaModel", "XLMRobertaModel", "BertForSequenceClassification"}


def saved(name, folder):
    hf = perturbed(BUILDERS[name]())
    hf.save_pretrained(folder)
    return hf, json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: saved(name, tmp_path_factory.mktemp(name)) for name in BUILDERS}


def hidden_states(hf, ids, mask):
    """transformers' encoder output: the base model's last hidden state."""
    with torch.no_grad():
        return hf.base_model(input_ids=ids.masked_fill(~mask, hf.config.pad_token_id), attention_mask=mask.long())[0]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_checkpoint_kind_computes_transformers_hidden_states(checkpoints, name):
    hf, config, state = checkpoints[name]
    cfg, params = from_transformers(config, state, where="ckpt")
    ids, mask = batch()
    ours = model.encode(params, cfg, ids, mask)
    assert (ours[mask] - hidden_states(hf, ids, mask)[mask]).abs().max().item() <= 1e-4
    head = [n for n in model.bert.shapes(cfg) if n.startswith("head.")]
    assert missing_head(cfg, params) == ([] if name in WITH_HEAD else head) and head
    assert cfg.pooler == (name in WITH_POOLER)
    if cfg.pooler:
        prefix = "" if name.endswith("Model") else "bert."
        for key in model.bert.POOLER:
            assert torch.equal(params[key], state[prefix + key])


def test_distilbert_with_its_head_computes_transformers_logits(checkpoints):
    hf, config, state = checkpoints["DistilBertForMaskedLM"]
    cfg, params = from_transformers(config, state, where="ckpt")
    assert (cfg.token_types, cfg.post_norm, cfg.position) == (0, True, "learned")
    ids, mask = batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
    ours = model.mlm_logits(params, cfg, model.encode(params, cfg, ids, mask))
    assert (ours[mask] - expected[mask]).abs().max().item() <= 1e-4


def test_a_made_head_completes_the_params_and_the_decoder_stays_tied(checkpoints):
    _, config, state = checkpoints["BertModel"]
    cfg, params = from_transformers(config, state, where="ckpt")
    names = missing_head(cfg, params)
    head = model.init(cfg, seed=3, names=names)
    assert list(head) == names
    assert torch.equal(head["head.dense.weight"], model.init(cfg, 3, names)["head.dense.weight"])
    assert torch.all(head["head.decoder.bias"] == 0) and torch.all(head["head.norm.weight"] == 1)
    full = {**params, **head}
    assert full.keys() == set(model.bert.shapes(cfg))
    logits = model.mlm_logits(full, cfg, model.encode(full, cfg, *batch()))
    assert logits.shape[-1] == V and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "kind, family",
    [("deberta-v2", "DeBERTa"), ("electra", "ELECTRA"), ("albert", "ALBERT"), ("gpt2", None)],
)
def test_a_family_cram_cannot_compute_is_refused_naming_it_and_the_key(kind, family):
    with pytest.raises(UnsupportedCheckpoint) as refused:
        from_transformers({**TINY, "model_type": kind}, {}, where="ckpt")
    message = str(refused.value)
    assert message.startswith(f"ckpt/config.json: model_type={kind!r}") and "\n" not in message
    assert (family in message) if family else "cram reads modernbert, bert, roberta, xlm-roberta, distilbert" in message


def test_a_classifier_with_a_stray_weight_is_still_refused(checkpoints):
    _, config, state = checkpoints["BertForSequenceClassification"]
    with pytest.raises(UnsupportedCheckpoint, match="weight bert.extra.weight has no place"):
        from_transformers(config, {**state, "bert.extra.weight": torch.zeros(2)}, where="ckpt")


@pytest.mark.parametrize("name", sorted(set(BUILDERS) - WITH_HEAD))
def test_each_headless_checkpoint_trains_a_step_with_a_made_head(checkpoints, name):
    _, config, state = checkpoints[name]
    cfg, params = from_transformers(config, state, where="ckpt")
    full = {**params, **model.init(cfg, seed=0, names=missing_head(cfg, params))}
    trained = {k: v for k, v in full.items() if k not in model.bert.POOLER}  # as pretrain carries the pooler
    step = model.make_train_step(cfg, model.AdamW(), model.EAGER)
    ids, _ = batch()
    positions = torch.tensor([1, 5, 30, 50])
    masked = {"input_ids": ids, "mlm_positions": positions, "mlm_labels": ids.reshape(-1)[positions]}
    after, _, metrics = step(trained, model.optimizer_init(model.AdamW(), trained), masked, torch.tensor(1e-3))
    assert torch.isfinite(metrics["loss"]) and not torch.equal(after["head.dense.weight"], full["head.dense.weight"])
