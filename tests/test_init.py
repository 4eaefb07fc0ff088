"""Continued pretraining (`[pretrain] init`): a transformers ModernBERT folder with its own tokenizer,
trained compiled from its own loss on, resumed after a kill, evaluated as it is with a zero budget; a cram
run directory and a cram export as starting points; and what is refused before any stage runs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bad_inputs import PIPELINE, WORDS, cram, write_workspace
from test_pretrain import kill_when_hanging, same_tensors, start_worker
from test_tokenizer import BERT, bert_style, word_level
from tokenizers import Tokenizer

from cram import model
from cram.stages import Upstream, pretrain
from cram.stages.pretraining.batches import read_sequences
from cram.stages.shared import pretrained
from cram.stages.shared.masking import Masking, mask_seed, mask_spec, mask_tokens
from cram.stages.shared.tokenizer import load as load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
EXTRA_ROWS = 8  # the checkpoint has more embedding rows than its tokenizer has tokens, as ModernBERT does
# The workspace pipeline of test_bad_inputs, its model table left out (the architecture is the checkpoint's).
INIT_PIPELINE = re.sub(r"\[pretrain\.model\]\n(.+\n)+\n", "", PIPELINE).replace(
    "[pretrain]\ncompile = false\n", '[pretrain]\ninit = "ckpt"\ncompile = true\n'
)


def modernbert(folder: Path) -> Path:
    """A small random ModernBertForMaskedLM with local and global layers (window 8 < blocks of 16) saved
    beside a BERT-style tokenizer, as a downloaded checkpoint folder holds both."""
    bert_style(folder)
    tok = load_tokenizer(folder)
    ids = tok.special_ids
    config = transformers.ModernBertConfig(
        vocab_size=tok.vocab_size + EXTRA_ROWS,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=64,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        local_attention=8,
        pad_token_id=ids["pad"],
        cls_token_id=ids["cls"],
        sep_token_id=ids["sep"],
        bos_token_id=ids["cls"],
        eos_token_id=ids["sep"],
    )
    torch.manual_seed(0)
    mlm = transformers.ModernBertForMaskedLM(config)
    # A head that predicts the workspace's words, as a trained one would (its bias favours their tokens):
    # a head no better than uniform is made anew (continued.untrained), and its own loss would not show.
    used = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(" ".join(WORDS), add_special_tokens=False).ids
    with torch.no_grad():
        mlm.decoder.bias.fill_(-3.0)
        mlm.decoder.bias[sorted(set(used))] = 3.0
    mlm.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return modernbert(tmp_path_factory.mktemp("modernbert") / "ckpt")


@pytest.fixture
def ws(tmp_path, monkeypatch, checkpoint) -> Path:
    """The test_bad_inputs workspace with the checkpoint at `ckpt` and INIT_PIPELINE, as the cwd."""
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    (tmp_path / "pipeline.toml").write_text(INIT_PIPELINE)
    return tmp_path


def stages_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"]


def hf_loss_on_first_batch(ckpt: Path, run: Path, microbatch: int) -> float:
    """The checkpoint's own MLM loss, computed by transformers, on the first microbatch of pretrain's
    stream masked as pretrain masks it (run seed 0)."""
    stages = stages_of(run)
    blocks = np.load(run / "pack" / stages["pack"]["outputs"]["train"])
    ids = torch.from_numpy(read_sequences(blocks, seed=0, first=0, count=microbatch, orders={}))
    special, vocab = stages["pack"]["outputs"]["special_ids"], stages["pack"]["outputs"]["vocab_size"]
    spec = mask_spec(Masking(), special, vocab, blocks.shape[1])
    batch = mask_tokens(ids, spec, torch.Generator().manual_seed(mask_seed(0, 0)))
    labels = torch.full((ids.numel(),), -100).index_put((batch["mlm_positions"],), batch["mlm_labels"])
    hf = transformers.ModernBertForMaskedLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        return hf(input_ids=batch["input_ids"], labels=labels.view(ids.shape)).loss.item()


def test_continuing_a_modernbert_checkpoint_starts_at_its_own_loss_with_its_tokenizer(ws):
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 0, result.output
    run = ws / "runs" / "base"
    stages = stages_of(run)
    assert stages["tokenize"]["outputs"]["tokenizer"] == "tokenizer.json"  # the checkpoint's, by default
    assert stages["tokenize"]["outputs"]["special_ids"] == load_tokenizer(ws / "ckpt").special_ids
    trained = json.loads((run / "pretrain" / "model.json").read_text())
    expected, _ = pretrained.load(pretrained.locate(ws / "ckpt"))
    assert trained == {**expected.__dict__, "pad_id": stages["tokenize"]["outputs"]["special_ids"]["pad"]}
    assert trained["local_attention"] == 8 and trained["vocab_size"] == stages["pack"]["outputs"]["vocab_size"] + 8
    first = json.loads((run / "pretrain" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(hf_loss_on_first_batch(ws / "ckpt", run, microbatch=4), rel=1e-4)
    # compiled, checked against eager, and passed: fp32 compiled differs from eager by float rounding only
    assert 0 <= stages["pretrain"]["outputs"]["canary_diff"] < 1e-4
    assert 0 < stages["evaluate"]["outputs"]["mlm_loss"] < 2 * math.log(trained["vocab_size"])
    # Round trip: the continued model, exported, is a ModernBERT that transformers computes alike.
    assert cram("export", "runs/base", "--to", "hf", "--format", "transformers").exit_code == 0
    hf = transformers.ModernBertForMaskedLM.from_pretrained(ws / "hf").eval()
    cfg, params = pretrained.load(pretrained.locate(ws / "runs" / "base"))
    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    ours = model.mlm_logits(params, cfg, model.encode(params, cfg, ids))
    assert (ours - expected).abs().max().item() <= 1e-4
    assert (ws / "hf" / "tokenizer.json").read_text() == (ws / "ckpt" / "tokenizer.json").read_text()


def test_the_example_config_checks_out_on_a_local_checkpoint(ws):
    result = cram(
        "run",
        str(REPO / "configs" / "continue-modernbert.toml"),
        "--dry-run",
        "--set",
        'pretrain.init="ckpt"',
        "--set",
        'tokenize.corpus.paths=["corpus.jsonl"]',
        "--set",
        "evaluate.tasks=[]",
    )
    assert result.exit_code == 0, result.output
    assert re.search(r"│ pretrain │ run ", result.output), result.output


def test_the_imported_layout_compiles_to_one_graph_without_breaks(checkpoint):
    cfg, params = pretrained.load(pretrained.locate(checkpoint))
    step = model.make_train_step(cfg, model.AdamW(), model.EAGER)
    ids = torch.randint(5, 100, (2, 16))
    positions = torch.tensor([1, 5, 17, 30])
    batch = {"input_ids": ids, "mlm_positions": positions, "mlm_labels": ids.reshape(-1)[positions]}
    explanation = torch._dynamo.explain(step)(
        params, model.optimizer_init(model.AdamW(), params), batch, torch.tensor(1e-3)
    )
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def test_a_zero_budget_evaluates_the_checkpoint_as_it_is(ws):
    result = cram("run", "pipeline.toml", "--set", "pretrain.budget.steps=0")
    assert result.exit_code == 0, result.output
    run = ws / "runs" / "base"
    outputs = stages_of(run)["pretrain"]["outputs"]
    assert outputs["steps"] == 0 and outputs["val_loss_start"] == outputs["val_loss_end"]
    _, imported = pretrained.load(pretrained.locate(ws / "ckpt"))
    written = load_file(run / "pretrain" / "params.safetensors")
    assert written.keys() == imported.keys() and all(torch.equal(written[k], imported[k]) for k in written)
    evaluate = stages_of(run)["evaluate"]["outputs"]
    vocab = stages_of(run)["pack"]["outputs"]["vocab_size"] + EXTRA_ROWS
    assert 0 < evaluate["mlm_loss"] < 2 * math.log(vocab)  # finite, about a random model's ln(vocab)
    assert 0 <= evaluate["sent_accuracy"] <= 1 and 0 <= evaluate["sent_baseline"] <= 1


def test_a_run_directory_and_its_export_are_starting_points_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    assert cram("run", "pipeline.toml").exit_code == 0
    assert cram("export", "runs/base", "--to", "exported").exit_code == 0
    zero = INIT_PIPELINE.replace('init = "ckpt"', "").replace(
        "[pretrain.budget]\nsteps = 2", "[pretrain.budget]\nsteps = 0"
    )
    (tmp_path / "zero.toml").write_text(zero.replace("compile = true", "compile = false"))
    for name, init in (("from-run", "runs/base"), ("from-export", "exported")):
        result = cram("run", "zero.toml", "--name", name, "--set", f'pretrain.init="{init}"')
        assert result.exit_code == 0, result.output
        outputs = stages_of(tmp_path / "runs" / name)["tokenize"]["outputs"]
        assert outputs["tokenizer"] == "tokenizer.model" and outputs["vocab_size"] == 96
        assert same_tensors(
            tmp_path / "runs" / name / "pretrain" / "params.safetensors", Path("exported/params.safetensors")
        )


def test_moving_the_checkpoint_keeps_the_key_and_changing_a_weight_does_not(ws):
    assert cram("run", "pipeline.toml", "--set", "pretrain.budget.steps=0").exit_code == 0
    shutil.move(ws / "ckpt", ws / "moved")
    moved = cram(
        "run", "pipeline.toml", "--set", "pretrain.budget.steps=0", "--set", 'pretrain.init="moved"', "--dry-run"
    )
    assert re.search(r"│ pretrain │ skip ", moved.output), moved.output
    state = load_file(ws / "moved" / "model.safetensors")
    state["model.final_norm.weight"] = state["model.final_norm.weight"] * 2
    save_file(state, ws / "moved" / "model.safetensors", metadata={"format": "pt"})
    changed = cram(
        "run", "pipeline.toml", "--set", "pretrain.budget.steps=0", "--set", 'pretrain.init="moved"', "--dry-run"
    )
    assert re.search(r"│ pretrain │ run ", changed.output), changed.output


def break_checkpoint(ws: Path, how: str) -> None:
    config_path, weights = ws / "ckpt" / "config.json", ws / "ckpt" / "model.safetensors"
    config = json.loads(config_path.read_text())
    if how == "activation":
        config_path.write_text(json.dumps({**config, "hidden_activation": "silu"}))
    elif how == "missing weight":
        state = load_file(weights)
        del state["model.layers.1.mlp.Wo.weight"]
        save_file(state, weights, metadata={"format": "pt"})
    elif how == "no mask token":
        tok = json.loads((ws / "ckpt" / "tokenizer.json").read_text())
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "[MASK]"]
        tok["model"]["vocab"].pop("[MASK]")
        (ws / "ckpt" / "tokenizer.json").write_text(json.dumps(tok))
        (ws / "ckpt" / "tokenizer_config.json").unlink()
        (ws / "ckpt" / "special_tokens_map.json").unlink(missing_ok=True)
    elif how == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (ws / "ckpt" / name).unlink(missing_ok=True)
    elif how == "bigger tokenizer":
        word_level(ws / "other" / "tokenizer.json", BERT + [f"w{i}" for i in range(195)])
    elif how == "no such folder":
        shutil.rmtree(ws / "ckpt")
    elif how in ("integer weight", "untied decoder"):
        state = load_file(weights)
        if how == "integer weight":  # an integer tensor would be read as weights of 0s and 1s
            state["model.final_norm.weight"] = torch.ones(state["model.final_norm.weight"].shape, dtype=torch.int32)
        else:  # a decoder of its own, while config.json ties it to the embeddings
            state["decoder.weight"] = state["model.embeddings.tok_embeddings.weight"] + 1
        save_file(state, weights, metadata={"format": "pt"})
    elif how == "config a list":
        config_path.write_text("[1, 2]")
    elif how == "config a string number":
        config_path.write_text(json.dumps({**config, "num_hidden_layers": "3"}))
    elif how == "config a string bool":
        config_path.write_text(json.dumps({**config, "tie_word_embeddings": "false"}))


REFUSALS = {
    "activation": ([], r"^error: pretrain\.init: .*ckpt/config\.json: hidden_activation='silu'"),
    "missing weight": ([], r"^error: pretrain\.init: .*ckpt: the weights lack model\.layers\.1\.mlp\.Wo\.weight"),
    "no mask token": ([], r"^error: tokenize\.tokenizer: .*ckpt/tokenizer\.json: no mask token"),
    "no tokenizer": ([], r"^error: pretrain\.init: ckpt holds no tokenizer"),
    "bigger tokenizer": (
        ["--set", 'tokenize.tokenizer="other"'],
        r"^error: tokenize\.tokenizer: 200 tokens, more than the 110 embedding rows",
    ),
    "no such folder": ([], r"^error: pretrain\.init: ckpt: no such folder"),
    "integer weight": (
        [],
        r"^error: pretrain\.init: .*ckpt: model\.final_norm\.weight holds int32 values; weights must be floating",
    ),
    "untied decoder": ([], r"^error: pretrain\.init: .*ckpt/config\.json: tie_word_embeddings=true and decoder\.w"),
    "config a list": ([], r"^error: pretrain\.init: .*ckpt/config\.json: a JSON list, not an object of settings"),
    "config a string number": ([], r'^error: pretrain\.init: .*ckpt/config\.json: num_hidden_layers="3"; expected an'),
    "config a string bool": ([], r'^error: pretrain\.init: .*ckpt/config\.json: tie_word_embeddings="false"; expected'),
    "task beyond positions": (
        ["--set", "pack.seq_len=128", "--set", "evaluate.buckets=[16, 128]", "--set", "evaluate.max_length=128"],
        r"^error: evaluate\.tasks\[0\]: max_length 128 pads to 128, beyond the 64 positions of pretrain\.init's",
    ),
    "contradiction": (
        ["--set", "pretrain.model.hidden=64"],
        r"^error: pretrain\.model\.hidden: 64 contradicts the checkpoint's 32",
    ),
    "preset": (
        ["--set", 'pretrain.model.preset="small"'],
        r"^error: pretrain\.model\.preset: 'small', but the architecture",
    ),
}


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("how", list(REFUSALS))
def test_a_checkpoint_that_cannot_be_continued_is_one_line_exit_2_and_nothing_written(ws, how, dry_run):
    break_checkpoint(ws, how)
    overrides, message = REFUSALS[how]
    result = cram("run", "pipeline.toml", *overrides, *(["--dry-run"] if dry_run else []))
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and re.search(message, result.output), result.output
    assert not (ws / "runs").exists()


def test_a_checkpoint_weight_holding_nan_stops_pretrain_naming_it(ws):
    """Finiteness needs the values: found when pretrain loads the checkpoint, before a step is taken."""
    state = load_file(ws / "ckpt" / "model.safetensors")
    state["model.layers.0.attn.Wo.weight"][1, 2] = float("nan")
    save_file(state, ws / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert "stage 'pretrain' failed: pretrain.init: ckpt: the weights of cram's layers.0.attn.out.weight hold" in error
    assert "NaN or inf" in error and not (ws / "runs" / "base" / "pretrain").exists()


def test_a_cram_checkpoint_with_an_integer_tensor_is_refused_from_its_header(tmp_path):
    cfg = model.ModelConfig(vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_seq_len=16)
    params = model.init(cfg, 0)
    params["final_norm.weight"] = torch.ones_like(params["final_norm.weight"], dtype=torch.int64)
    save_file(params, tmp_path / "params.safetensors")
    (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    for shapes_only in (True, False):
        with pytest.raises(pretrained.PretrainedError, match="final_norm.weight holds int64 values; weights must be"):
            pretrained.load(pretrained.locate(tmp_path), shapes_only=shapes_only)


@pytest.mark.slow
def test_continued_pretraining_resumes_after_a_kill_as_if_never_stopped(checkpoint, tmp_path, make_ctx):
    folder = tmp_path / "pack"
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(5, 100, size=(256, 16), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(5, 100, size=(16, 16), dtype=np.uint16))
    special = load_tokenizer(checkpoint).special_ids
    outputs = {"train": "train.npy", "val": "val.npy", "seq_len": 16, "vocab_size": 100, "special_ids": special}
    inputs = {"pack": Upstream(folder, outputs)}
    config = pretrain.Config(
        init=str(checkpoint),
        budget=pretrain.Budget(steps=6),
        microbatch=4,
        batch_size=4,
        compile=True,
        backend="aot_eager",
        precision="fp32",
        log_every_steps=1,
        checkpoint_every_minutes=0,
        checkpoint_every_steps=2,
        val_blocks=8,
    )
    straight = pretrain.run(config, inputs, tmp_path / "straight", make_ctx())
    out_dir = tmp_path / "killed"
    # Killed in step 5 (after the checkpoint of step 4): 16 maskings measure the checkpoint's own head (one
    # a held-out block; on these random tokens it predicts worse than uniform, so it is made anew and warmed
    # up), 1 compiles and 4 are the canary's for each of the two modes, 8 the held-out loss, then 1 a step.
    kill_when_hanging(
        start_worker(
            tmp_path, {"config": config, "inputs": inputs, "out_dir": str(out_dir), "hang": ("mask_tokens", 39)}
        ),
        out_dir,
    )
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step-*")) == ["step-2", "step-4"]
    resumed = pretrain.run(config, inputs, out_dir, make_ctx())
    assert same_tensors(out_dir / "params.safetensors", tmp_path / "straight" / "params.safetensors")
    for key in ("steps", "tokens_seen", "final_loss", "loss_start", "val_loss_start"):
        assert resumed[key] == straight[key], key
