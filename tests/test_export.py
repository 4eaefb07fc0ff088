"""Export of a run's encoder: cram's format and its re-import, and transformers' ModernBERT."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from cram import model
from cram.model import ModelConfig
from cram.model.classifier import init_head_params, make_finetune_step
from cram.model.hf import transformers_blockers
from cram.pipeline.commands import cli
from cram.pipeline.commands.export import ExportError, export
from cram.stages import tokenize
from cram.stages.kept import FORMATS, KeptError, load_export
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

MODERNBERT = ModelConfig(
    vocab_size=200,
    hidden=32,
    layers=2,
    heads=4,
    intermediate=64,
    max_seq_len=24,
    norm_eps=1e-5,
    position="rope",
    head_transform=True,
    first_attn_norm=False,
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A  cafe in Zürich serves “fine” coffee — ½ price on Mondays!",
    "Numbers like 1,234.5 and words like tokenizer, tokenize, tokens.",
    "The [MASK] sat on the mat.",
]
# BERT's layout at MODERNBERT's sizes: post-norm, learned positions, biases, two token types.
BERT = dataclasses.replace(
    MODERNBERT,
    position="learned",
    first_attn_norm=True,
    glu=False,
    post_norm=True,
    linear_bias=True,
    norm_bias=True,
    token_types=2,
    decoder_bias=True,
    norm_eps=1e-12,
)


def corpus():
    words = "the of and a to in is was for on with as by at from that which cat dog mat sat fox over".split()
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        picks = torch.randint(len(words), (12,), generator=gen).tolist()
        yield " ".join(words[i] for i in picks).capitalize() + ". " + SENTENCES[len(picks) % 3]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(tokenize.train_tokenizer(corpus(), tokenize.Config(vocab_size=MODERNBERT.vocab_size)))
    return path


def fake_run(root, sp_model, cfg=MODERNBERT, pretrain_status="done"):
    """A run directory holding just what export reads: manifest, config, tokenizer, params, model.json.
    sp_model: a sentencepiece model, or the tokenizer.json of a run that reused a tokenizers tokenizer."""
    run = root / "runs" / "run"
    (run / "tokenize").mkdir(parents=True)
    (run / "pretrain").mkdir()
    tokenizer = "tokenizer.json" if sp_model.suffix == ".json" else "tokenizer.model"
    (run / "tokenize" / tokenizer).write_bytes(sp_model.read_bytes())
    # Larger than init's 0.02 std so that the logits comparison is not between near-zero numbers.
    params = {k: v * 10 if v.ndim == 2 else v + 0.1 * torch.randn_like(v) for k, v in model.init(cfg, seed=0).items()}
    save_file(params, run / "pretrain" / "params.safetensors")
    (run / "pretrain" / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    (run / "config.toml").write_text('[run]\nname = "run"\n\n[pretrain.optimizer]\nlr = 0.003\n')
    stages = {
        "tokenize": {
            "status": "done",
            "outputs": {"tokenizer": tokenizer, "special_ids": SPECIAL_IDS},
        },
        "pretrain": {
            "status": pretrain_status,
            "outputs": {"params": "params.safetensors", "model_config": "model.json", "final_loss": 3.25},
        },
    }
    (run / "manifest.json").write_text(json.dumps({"run": "run", "stages": stages}))
    return run, params


def test_cram_export_loads_back_and_fine_tunes(tmp_path, sp_model):
    run, params = fake_run(tmp_path, sp_model)
    out = export(run, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        ".cram-export",
        "README.md",
        "checksums.json",
        "model.json",
        "params.safetensors",
        "special_ids.json",
        "tokenizer.model",
    ]
    card = (out / "README.md").read_text()
    assert "final_loss 3.25" in card and "lr = 0.003" in card
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left behind

    cfg, loaded, tokenizer = load_export(out)
    assert cfg == MODERNBERT and tokenizer.read_bytes() == sp_model.read_bytes()
    assert loaded.keys() == params.keys() and all(torch.equal(loaded[k], params[k]) for k in params)
    tuned = {**loaded, **init_head_params(cfg, num_outputs=2, seed=0)}
    step = make_finetune_step(cfg, model.AdamW(), model.EAGER)
    batch = {
        "input_ids": torch.randint(5, cfg.vocab_size, (4, 16)),
        "attention_mask": torch.ones(4, 16, dtype=torch.bool),
        "labels": torch.tensor([0, 1, 0, 1]),
        "weights": torch.ones(4),
    }
    tuned, _, metrics = step(tuned, model.optimizer_init(model.AdamW(), tuned), batch, torch.tensor(1e-3))
    assert torch.isfinite(metrics["loss"])
    assert not torch.equal(tuned["layers.0.attn.qkv.weight"], loaded["layers.0.attn.qkv.weight"])


def test_export_refuses_bad_input_and_replaces_only_with_force(tmp_path, sp_model):
    run, _ = fake_run(tmp_path, sp_model)
    target = tmp_path / "export"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    for force in (False, True):  # a folder that is not an earlier export is never replaced
        with pytest.raises(ExportError, match="not empty and not an earlier export"):
            export(run, target, force=force)
    assert (target / "keep.txt").read_text() == "mine"
    export(run, tmp_path / "again")
    with pytest.raises(ExportError, match="holds an earlier export; pass --force"):
        export(run, tmp_path / "again")
    (tmp_path / "again" / "stale.txt").write_text("from an older export")
    export(run, tmp_path / "again", force=True)
    assert not (tmp_path / "again" / "stale.txt").exists() and (tmp_path / "again" / "params.safetensors").is_file()
    with pytest.raises(ExportError, match="--format onnx: allowed cram, transformers"):
        export(run, tmp_path / "other", fmt="onnx")
    with pytest.raises(KeptError, match="no model.json; is it a cram-format export"):
        load_export(tmp_path)

    model_json = run / "pretrain" / "model.json"
    model_json.write_text(json.dumps({**dataclasses.asdict(MODERNBERT), "attention_window": 128}))
    with pytest.raises(ExportError, match=r"model.json: not a readable model config \(unknown key 'attention_window'"):
        export(run, tmp_path / "unknown")
    assert not (tmp_path / "unknown").exists()
    model_json.write_text(json.dumps(dataclasses.asdict(MODERNBERT)))

    unfinished, _ = fake_run(tmp_path / "b", sp_model, pretrain_status="running")
    result = CliRunner().invoke(cli.app, ["export", str(unfinished), "--to", str(tmp_path / "x")])
    assert result.exit_code == 2 and "stage pretrain is not done (status running)" in result.output
    assert not (tmp_path / "x").exists()


def test_transformers_export_names_every_blocking_option(tmp_path, sp_model):
    assert transformers_blockers(MODERNBERT) == []
    crammed = ModelConfig(
        vocab_size=300, hidden=32, layers=1, heads=2, intermediate=64, glu=False, embedding_norm=False
    )
    assert transformers_blockers(crammed) == [
        'pretrain.model.position="rope"',
        "pretrain.model.head_transform=true",
        "pretrain.model.first_attn_norm=false",
        "pretrain.model.glu=true",
        "pretrain.model.embedding_norm=true",
    ]
    run, _ = fake_run(tmp_path, sp_model, cfg=crammed)
    result = CliRunner().invoke(cli.app, ["export", str(run), "--to", str(tmp_path / "hf"), "--format", "transformers"])
    assert result.exit_code == 2
    assert "does not map onto transformers' ModernBERT" in result.output and "glu=true" in result.output


def test_transformers_export_matches_cram_logits_and_tokens(tmp_path, sp_model):
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    run, params = fake_run(tmp_path, sp_model)
    out = export(run, tmp_path / "hf", fmt="transformers")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "ModernBertForMaskedLM"
    assert hf.config.layer_types == ["full_attention"] * MODERNBERT.layers
    ids = torch.randint(5, MODERNBERT.vocab_size, (3, MODERNBERT.max_seq_len))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 15:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
    ours = model.mlm_logits(params, MODERNBERT, model.encode(params, MODERNBERT, ids, mask))
    assert (ours[mask] - expected[mask]).abs().max().item() <= 1e-4

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    special = SPECIAL_IDS
    assert (tokenizer.pad_token_id, tokenizer.mask_token_id) == (special["pad"], special["mask"])
    for text in SENTENCES[:3]:
        assert tokenizer(text)["input_ids"] == [special["cls"], *sp.encode(text), special["sep"]], text
    a, b = SENTENCES[0], SENTENCES[2]
    assert tokenizer(a, b)["input_ids"] == [
        special["cls"],
        *sp.encode(a),
        special["sep"],
        *sp.encode(b),
        special["sep"],
    ]
    # Typed special tokens become their ids (sentencepiece reads them as text): what fill-mask needs.
    before, after = SENTENCES[3].split("[MASK]")
    masked = tokenizer(SENTENCES[3], add_special_tokens=False)["input_ids"]
    assert masked == [*sp.encode(before), special["mask"], *sp.encode(after)]


def test_a_bert_layout_and_a_reused_tokenizer_json_export_to_both_formats(tmp_path, sp_model):
    transformers = pytest.importorskip("transformers")
    from cram.stages.kept.fast_tokenizer import fast_tokenizer

    tokenizer_json = tmp_path / "tokenizer.json"
    fast_tokenizer(sp_model, SPECIAL_IDS).save(str(tokenizer_json))
    run, params = fake_run(tmp_path, tokenizer_json, cfg=BERT)
    cfg, loaded, tokenizer = load_export(export(run, tmp_path / "cram"))
    assert cfg == BERT and tokenizer.name == "tokenizer.json" and tokenizer.read_bytes() == tokenizer_json.read_bytes()
    assert not (tmp_path / "cram" / "tokenizer.model").exists()

    out = export(run, tmp_path / "hf", fmt="transformers")
    reused, written = (
        transformers.PreTrainedTokenizerFast(tokenizer_file=str(f)) for f in (tokenizer_json, out / "tokenizer.json")
    )
    assert written(SENTENCES, SENTENCES[::-1])["input_ids"] == reused(SENTENCES, SENTENCES[::-1])["input_ids"]
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForMaskedLM"
    ids = torch.randint(5, BERT.vocab_size, (2, BERT.max_seq_len))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 10:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
    ours = model.mlm_logits(params, BERT, model.encode(params, BERT, ids, mask))
    assert (ours[mask] - expected[mask]).abs().max().item() <= 1e-4
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.mask_token_id) == (SPECIAL_IDS["pad"], SPECIAL_IDS["mask"])

    rope_bert = dataclasses.replace(BERT, position="rope")
    run, _ = fake_run(tmp_path / "b", sp_model, cfg=rope_bert)
    with pytest.raises(ExportError, match="does not map onto transformers' BERT; set pretrain.model.position="):
        export(run, tmp_path / "rope", fmt="transformers")


@pytest.mark.parametrize(
    "target, message",
    [
        ("runs/run", "inside the runs folder"),
        ("runs/run/pretrain", "inside the runs folder"),
        ("runs", "inside the runs folder"),
        ("runs/other-run", "inside the runs folder"),
        (".", "holds the runs folder"),
        ("..", "holds the runs folder"),
        ("elsewhere/run2/sub", "inside the run directory"),
    ],
)
def test_export_never_touches_a_run_or_the_runs_folder(tmp_path, sp_model, monkeypatch, target, message):
    run, _ = fake_run(tmp_path, sp_model)
    other = tmp_path / "elsewhere" / "run2"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text('{"stages": {}}')
    monkeypatch.chdir(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli.app, ["export", "runs/run", "--to", target, "--force"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_export_names_a_missing_params_file(tmp_path, sp_model):
    run, _ = fake_run(tmp_path, sp_model)
    (run / "pretrain" / "params.safetensors").unlink()
    result = CliRunner().invoke(cli.app, ["export", str(run), "--to", str(tmp_path / "out")])
    assert result.exit_code == 2 and "params.safetensors: missing, though stage pretrain is done" in result.output
    assert not (tmp_path / "out").exists()


def test_export_help_names_every_format_the_exporter_writes():
    """`--format`'s help is made from the exporter's registry of formats, so a format added there is named."""
    result = CliRunner().invoke(cli.app, ["export", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    help_text = " ".join(result.output.split())
    assert len(FORMATS) >= 3
    for name, holds in FORMATS.items():
        assert f"{name} ({holds})" in help_text
