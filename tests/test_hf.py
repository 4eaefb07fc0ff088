"""The mapping between cram and transformers checkpoints (`model/hf.py`): logits equal both ways, refusals."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cram import model
from cram.model import ModelConfig
from cram.model.hf import (
    UnsupportedCheckpoint,
    from_transformers,
    to_transformers,
    transformers_blockers,
    values_compared,
)
from cram.stages.shared.special import SPECIAL_IDS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

V, S = 120, 24
TINY = dict(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=S)
MODERNBERT = dict(
    TINY,
    intermediate_size=32,
    layer_types=["full_attention", "sliding_attention"] * 2,
    local_attention=8,  # a query reads 4 positions each side: the window is smaller than the sequence
    decoder_bias=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
)
BERT = dict(TINY, num_hidden_layers=2, intermediate_size=64, pad_token_id=0)
ROBERTA = dict(BERT, pad_token_id=1, max_position_embeddings=S + 2, type_vocab_size=1)
CHECKPOINTS = {
    "modernbert": lambda: transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**MODERNBERT)),
    "modernbert-biases": lambda: transformers.ModernBertForMaskedLM(
        transformers.ModernBertConfig(
            **MODERNBERT, attention_bias=True, mlp_bias=True, classifier_bias=True, norm_bias=True
        )
    ),
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**BERT)),
    "roberta": lambda: transformers.RobertaForMaskedLM(transformers.RobertaConfig(**ROBERTA)),
}


def perturbed(hf):
    """Every weight moved off its init (zero biases, unit norms), so that each one's mapping matters."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return hf.eval()


def saved(name, folder):
    """A random checkpoint saved by transformers, and what cram reads of it: (model, config.json, weights)."""
    hf = perturbed(CHECKPOINTS[name]())
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    return hf, config, load_file(folder / "model.safetensors")


def batch(seed=0):
    """Ids that are never a special token, and right padding longer than the local window's reach."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, S), generator=gen)
    mask = torch.ones(3, S, dtype=torch.bool)
    mask[1, 15:] = False
    mask[2, 5:] = False
    return ids, mask


def assert_same_logits(hf, cfg, params):
    ids, mask = batch()
    with torch.no_grad():
        expected = hf(input_ids=ids.masked_fill(~mask, hf.config.pad_token_id), attention_mask=mask.long()).logits
    ours = model.mlm_logits(params, cfg, model.encode(params, cfg, ids, mask))
    assert (ours[mask] - expected[mask]).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: saved(name, tmp_path_factory.mktemp(name)) for name in CHECKPOINTS}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_transformers_checkpoint_computes_the_same_logits_in_cram(checkpoints, name):
    hf, config, state = checkpoints[name]
    cfg, params = from_transformers(config, state, where="ckpt")
    assert params.keys() == set(model.bert.shapes(cfg))
    assert model.parameter_count(cfg) == model.num_params(params)
    assert_same_logits(hf, cfg, params)


def test_the_configs_map_onto_cram_fields(checkpoints):
    modern, _ = from_transformers(*checkpoints["modernbert"][1:], where="ckpt")
    assert (modern.local_attention, modern.global_every, modern.intermediate) == (8, 2, 64)
    assert (modern.rope_theta, modern.local_rope_theta, modern.decoder_bias) == (160_000.0, 10_000.0, True)
    assert (modern.position, modern.first_attn_norm, modern.linear_bias, modern.max_seq_len) == (
        "rope",
        False,
        False,
        S,
    )
    bert, _ = from_transformers(*checkpoints["bert"][1:], where="ckpt")
    assert (bert.post_norm, bert.token_types, bert.position_offset, bert.max_seq_len) == (True, 2, 0, S)
    roberta, _ = from_transformers(*checkpoints["roberta"][1:], where="ckpt")
    assert (roberta.position_offset, roberta.max_seq_len, roberta.token_types, roberta.pad_id) == (2, S, 1, 1)
    _, config, state = checkpoints["roberta"]
    assert from_transformers({**config, "model_type": "xlm-roberta"}, state, where="ckpt")[0] == roberta


def test_the_older_modernbert_config_spelling_reads_the_same(checkpoints):
    _, config, state = checkpoints["modernbert"]
    old = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    old |= {"global_attn_every_n_layers": 2, "global_rope_theta": 160_000.0, "local_rope_theta": 10_000.0}
    assert from_transformers(old, state, "ckpt")[0] == from_transformers(config, state, "ckpt")[0]


# cram configs for each transformers layout, with every optional part present.
LAYOUTS = {
    "modernbert-local": ModelConfig(
        vocab_size=V,
        hidden=32,
        layers=4,
        heads=4,
        intermediate=64,
        max_seq_len=S,
        norm_eps=1e-5,
        position="rope",
        head_transform=True,
        first_attn_norm=False,
        local_attention=8,
        global_every=3,
        rope_theta=160_000.0,
        local_rope_theta=10_000.0,
        decoder_bias=True,
        linear_bias=True,
    ),
    "bert": ModelConfig(
        vocab_size=V,
        hidden=32,
        layers=2,
        heads=4,
        intermediate=64,
        max_seq_len=S,
        position="learned",
        glu=False,
        head_transform=True,
        post_norm=True,
        linear_bias=True,
        norm_bias=True,
        decoder_bias=True,
        token_types=2,
    ),
}
LAYOUTS["roberta"] = dataclasses.replace(LAYOUTS["bert"], position_offset=2, pad_id=1, token_types=1)
# BERT's layout without the biases and type table that cram leaves out: written as zeros.
LAYOUTS["bert-bias-free"] = dataclasses.replace(
    LAYOUTS["bert"], linear_bias=False, norm_bias=False, decoder_bias=False, token_types=0
)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cram_params_load_into_transformers_with_the_same_logits(tmp_path, name):
    cfg = LAYOUTS[name]
    gen = torch.Generator().manual_seed(1)
    params = {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in model.init(cfg, seed=0).items()}
    assert transformers_blockers(cfg) == []
    config, state = to_transformers(cfg, params, {**SPECIAL_IDS, "pad": cfg.pad_id})
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, tmp_path / "model.safetensors")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == config["architectures"][0]
    assert_same_logits(hf, cfg, params)
    if name != "bert-bias-free":  # read back: the same config and tensors
        back, loaded = from_transformers(config, state, where="out")
        assert back == cfg and loaded.keys() == params.keys()
        assert all(torch.equal(loaded[k], params[k]) for k in params)


def test_layouts_transformers_cannot_hold_name_the_fields():
    rope_bert = dataclasses.replace(LAYOUTS["bert"], position="rope")
    assert transformers_blockers(rope_bert) == ['pretrain.model.position="learned"']
    assert transformers_blockers(dataclasses.replace(LAYOUTS["modernbert-local"], token_types=2)) == [
        "pretrain.model.token_types=0"
    ]
    assert transformers_blockers(dataclasses.replace(LAYOUTS["roberta"], pad_id=0)) == [
        "pretrain.model.position_offset=1"
    ]
    with pytest.raises(UnsupportedCheckpoint, match="onto transformers' BERT; set pretrain.model.position"):
        to_transformers(rope_bert, model.init(rope_bert, seed=0), SPECIAL_IDS)


REFUSALS = [
    ("bert", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("modernbert", {"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ("modernbert", {"classifier_activation": "tanh"}, "classifier_activation='tanh'"),
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ("bert", {"is_decoder": True}, "is_decoder=true"),
    ("roberta", {"add_cross_attention": True}, "add_cross_attention=true"),
    ("modernbert", {"attention_bias": True}, "attention_bias, mlp_bias and classifier_bias"),
    ("modernbert", {"model_type": "gpt2"}, "model_type='gpt2'"),
    ("modernbert", {"layer_types": ["sliding_attention", "full_attention"] * 2}, "layer_types="),
    ("modernbert", {"layer_types": ["full_attention"] * 3}, "layer_types="),
    ("modernbert", {"local_attention": 0}, "local_attention=0"),
    (
        "modernbert",
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
        "rope_parameters.full_attention.rope_type='linear'",
    ),
    ("bert", {"vocab_size": 7}, "has shape"),
    # config.json values of the wrong JSON type: named, never a traceback or a string read by its truth
    ("bert", {"hidden_size": "32"}, 'hidden_size="32"; expected an integer'),
    ("bert", {"num_hidden_layers": 2.0}, "num_hidden_layers=2.0; expected an integer"),
    ("bert", {"vocab_size": True}, "vocab_size=true; expected an integer"),
    ("modernbert", {"norm_eps": "1e-5"}, 'norm_eps="1e-5"; expected a number'),
    ("modernbert", {"decoder_bias": "false"}, 'decoder_bias="false"; expected true or false'),
    ("bert", {"is_decoder": 1}, "is_decoder=1; expected true or false"),
    ("modernbert", {"layer_types": "full_attention"}, 'layer_types="full_attention"; expected a list'),
    ("modernbert", {"rope_parameters": [1]}, "rope_parameters=[1]; expected an object"),
    (
        "modernbert",
        {"rope_parameters": {"full_attention": {"rope_theta": "big"}}},
        'rope_parameters.full_attention={"rope_theta": "big"}; expected an object with a number rope_theta',
    ),
]


@pytest.mark.parametrize("name, change, message", REFUSALS)
def test_an_unsupported_feature_is_refused_naming_its_key(checkpoints, name, change, message):
    _, config, state = checkpoints[name]
    with pytest.raises(UnsupportedCheckpoint, match="^ckpt") as refused:
        from_transformers({**config, **change}, state, where="ckpt")
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("config", [[1, 2], "modernbert", 3])
def test_a_config_that_is_not_a_json_object_is_refused_naming_the_file(config):
    with pytest.raises(UnsupportedCheckpoint, match=r"^ckpt/config\.json: a JSON \w+, not an object of settings$"):
        from_transformers(config, {}, where="ckpt")


def test_a_null_is_read_as_the_key_left_out(checkpoints):
    _, config, state = checkpoints["bert"]
    nulls = {**config, "layer_norm_eps": None, "rope_scaling": None}
    assert from_transformers(nulls, state, where="ckpt")[0] == from_transformers(config, state, where="ckpt")[0]


def test_a_check_from_the_headers_reads_only_the_tied_decoder_copy_and_what_it_repeats():
    names = {"decoder.weight", "model.embeddings.tok_embeddings.weight", "model.final_norm.weight"}
    assert values_compared({"model_type": "modernbert"}, names) == names - {"model.final_norm.weight"}
    assert values_compared({"model_type": "modernbert"}, names - {"decoder.weight"}) == set()
    bert = {"cls.predictions.decoder.bias", "cls.predictions.bias", "bert.embeddings.word_embeddings.weight"}
    expected = {"cls.predictions.decoder.bias", "cls.predictions.bias"}  # no decoder weight: no embeddings
    assert values_compared({"model_type": "bert"}, bert | {"bert.pooler.dense.weight"}) == expected
    roberta = {"lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight"}
    assert values_compared({"model_type": "xlm-roberta"}, roberta) == roberta
    assert values_compared({"model_type": "gpt2"}, names) == values_compared([1], names) == set()


def test_a_missing_weight_an_untied_decoder_and_an_unknown_weight_are_refused(checkpoints):
    _, config, state = checkpoints["bert"]
    lacking = {k: v for k, v in state.items() if k != "bert.encoder.layer.1.attention.self.key.bias"}
    with pytest.raises(UnsupportedCheckpoint, match=r"lack bert.encoder.layer.1.attention.self.key.bias \(cram's "):
        from_transformers(config, lacking, where="ckpt")
    embeddings = state["bert.embeddings.word_embeddings.weight"]
    untied = {**state, "cls.predictions.decoder.weight": embeddings + 1}
    with pytest.raises(UnsupportedCheckpoint, match="tie_word_embeddings=false and cls.predictions.decoder.weight"):
        from_transformers({**config, "tie_word_embeddings": False}, untied, where="ckpt")
    with pytest.raises(UnsupportedCheckpoint, match="weight cls.predictions.extra has no place"):
        from_transformers(config, {**state, "cls.predictions.extra": embeddings}, where="ckpt")
    # What BERT's pretraining checkpoints also hold, and the tied decoder's copy, are read past; the pooler is kept.
    harmless = {
        **state,
        "bert.pooler.dense.weight": torch.ones(32, 32),
        "bert.pooler.dense.bias": torch.zeros(32),
        "cls.seq_relationship.bias": torch.zeros(2),
        "bert.embeddings.position_ids": torch.arange(S)[None],
        "cls.predictions.decoder.weight": embeddings,
    }
    with_pooler, params = from_transformers(config, harmless, where="ckpt")
    assert with_pooler == dataclasses.replace(from_transformers(config, state, where="ckpt")[0], pooler=True)
    assert torch.equal(params["pooler.dense.weight"], torch.ones(32, 32))


@pytest.mark.parametrize(
    "field, value",
    [
        ("local_attention", -1),
        ("global_every", 0),
        ("local_rope_theta", 0.0),
        ("position_offset", -2),
        ("token_types", -1),
    ],
)
def test_the_new_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"model.{field}"):
        ModelConfig(**{"position": "learned", field: value})


def test_offsets_need_learned_positions_and_post_norm_every_norm():
    with pytest.raises(ValueError, match="model.position_offset=2: only learned positions"):
        ModelConfig(position_offset=2)
    with pytest.raises(ValueError, match="model.first_attn_norm=false"):
        ModelConfig(post_norm=True, first_attn_norm=False)
