"""Issue 46's switches past ModernBERT's layout: QK-norm, zero-initialised output projections and Muon.
What each computes, that each compiles with the step into one graph that never recompiles and matches eager,
and that export and continued pretraining refuse what they cannot hold."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_bad_inputs import cram
from test_export import MODERNBERT, fake_run, sp_model  # noqa: F401 (sp_model: a fixture)
from test_init import checkpoint, ws  # noqa: F401 (fixtures)
from test_pretrain import pack, same_tensors, small  # noqa: F401 (pack: a fixture)
from test_step import random_batch
from typer.testing import CliRunner

from cram import model
from cram.model import AdamW, ModelConfig, Muon, bert, muon, optimizer_config
from cram.model.hf import transformers_blockers
from cram.pipeline.commands import cli
from cram.pipeline.commands.export import export
from cram.stages import pretrain
from cram.stages.kept import load_export
from cram.stages.pretraining import checkpoint as checkpoints
from cram.stages.shared import pretrained

pytestmark = pytest.mark.usefixtures("one_thread")

# Two layers, rope (QK-norm comes before it).
BASE = ModelConfig(
    vocab_size=256,
    hidden=32,
    layers=2,
    heads=2,
    intermediate=64,
    max_seq_len=16,
    position="rope",
    first_attn_norm=False,
)
SWITCHES = {
    "qk_norm": dict(qk_norm=True),
    "zero_init_out": dict(zero_init_out=True),
    "all": dict(qk_norm=True, zero_init_out=True),
}
ADAMW, MUON = AdamW(), Muon()
AOT_EAGER = model.Compilation(backend="aot_eager")


def cfg_of(switch: str) -> ModelConfig:
    return dataclasses.replace(BASE, **SWITCHES[switch])


# --- what each switch computes --------------------------------------------------------------------


def test_the_switches_are_off_by_default_and_add_their_parameters_only_when_on():
    plain = ModelConfig()
    assert (plain.qk_norm, plain.zero_init_out) == (False, False)
    assert set(bert.shapes(cfg_of("all"))) - set(bert.shapes(BASE)) == {
        "layers.0.attn.q_norm.weight",
        "layers.0.attn.k_norm.weight",
        "layers.1.attn.q_norm.weight",
        "layers.1.attn.k_norm.weight",
    }
    params = model.init(cfg_of("all"), seed=0)
    assert params["layers.0.attn.q_norm.weight"].shape == (BASE.head_dim,)


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_parameter_count_is_what_init_makes(switch):
    cfg = cfg_of(switch)
    assert model.parameter_count(cfg) == model.num_params(model.init(cfg, seed=0))


def test_zero_init_zeroes_the_output_projections_and_leaves_every_other_parameter_as_the_seed_gives_it():
    plain, zeroed = model.init(BASE, seed=3), model.init(cfg_of("zero_init_out"), seed=3)
    outputs = {name for name in plain if name.endswith(bert.OUTPUTS)}
    assert len(outputs) == 2 * BASE.layers
    for name, p in plain.items():
        if name in outputs:
            assert torch.count_nonzero(zeroed[name]) == 0 and torch.count_nonzero(p) > 0, name
        else:
            assert torch.equal(zeroed[name], p), name
    # Every block adds nothing at first: the encoder's output is the final norm of the embeddings.
    ids = torch.randint(5, BASE.vocab_size, (2, BASE.max_seq_len))
    hidden = model.encode(zeroed, cfg_of("zero_init_out"), ids)
    embedded = F.embedding(ids, zeroed["embed.tokens.weight"])
    normed = F.layer_norm(embedded, (BASE.hidden,), zeroed["embed.norm.weight"], eps=BASE.norm_eps)
    expected = F.layer_norm(normed, (BASE.hidden,), zeroed["final_norm.weight"], eps=BASE.norm_eps)
    assert torch.allclose(hidden, expected, atol=1e-6)


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    ids = torch.randint(5, BASE.vocab_size, (2, BASE.max_seq_len))
    for cfg, blind in ((BASE, False), (cfg_of("qk_norm"), True)):
        params = model.init(cfg, seed=0)
        scaled = dict(params)
        rows = torch.ones(3 * BASE.hidden, 1)
        rows[: 2 * BASE.hidden] = 7.0  # the query and key rows of the qkv projection
        scaled["layers.0.attn.qkv.weight"] = params["layers.0.attn.qkv.weight"] * rows
        same = torch.allclose(model.encode(params, cfg, ids), model.encode(scaled, cfg, ids), atol=1e-5)
        assert same == blind


def test_a_cls_pooled_encoding_of_every_switch_matches_the_full_one():
    cfg = cfg_of("all")
    params = {k: v + 0.05 * torch.randn_like(v) for k, v in model.init(cfg, seed=0).items()}
    ids = torch.randint(5, BASE.vocab_size, (2, BASE.max_seq_len))
    full = model.encode(params, cfg, ids)[:, :1]
    assert torch.allclose(model.encode(params, cfg, ids, first_only=True), full, atol=1e-5)


# --- Muon -----------------------------------------------------------------------------------------


def test_muon_takes_every_layers_four_hidden_matrices_and_nothing_else():
    """A ModelConfig has at least one layer, so Muon always has matrices to take: no model refuses it."""
    bert_layout = dataclasses.replace(BASE, linear_bias=True, post_norm=True, first_attn_norm=True)
    for cfg in [*model.PRESETS.values(), cfg_of("all"), bert_layout]:
        taken = [name for name in bert.shapes(cfg) if muon.takes(name)]
        assert len(taken) == 4 * cfg.layers, cfg
        assert all(len(bert.shapes(cfg)[name]) == 2 for name in taken)
    assert not any(muon.takes(name) for name in bert.shapes(BASE) if not name.startswith("layers."))


def torch_muon_step(weights: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, decay: float):
    """`weights` after `torch.optim.Muon` (Moonlight's lr rule) steps on `grads`."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.Muon(params, lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw")
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def test_muon_steps_as_torch_optim_muon_does_each_fused_matrix_as_the_ones_it_stacks():
    torch.manual_seed(0)
    H, steps, lr, decay = 32, 3, torch.tensor(0.02), 0.1
    weights = {"layers.0.attn.qkv.weight": torch.randn(3 * H, H), "layers.0.attn.out.weight": torch.randn(H, H)}
    weights |= {"layers.0.ffn.up.weight": torch.randn(4 * H, H), "layers.0.ffn.down.weight": torch.randn(H, 2 * H)}
    grads = [{name: torch.randn_like(w) for name, w in weights.items()} for _ in range(steps)]
    ours, momenta = dict(weights), {name: torch.zeros_like(w) for name, w in weights.items()}
    shapes = {name: w.shape for name, w in weights.items()}
    for step_grads in grads:
        for name in ours:
            blocks = muon.stacked(name, shapes)
            ours[name], momenta[name] = muon.muon_param(ours[name], step_grads[name], momenta[name], blocks, lr, decay)
    assert {name: muon.stacked(name, shapes) for name in weights} == dict(zip(weights, (3, 1, 2, 1)))
    for name, w in weights.items():
        blocks = muon.stacked(name, shapes)
        theirs = torch_muon_step(list(w.chunk(blocks)), [list(g[name].chunk(blocks)) for g in grads], lr.item(), decay)
        moved, expected = ours[name] - w, torch.cat(theirs) - w
        # torch's Newton-Schulz runs in bf16, ours in fp32: they agree to bf16's rounding.
        assert (moved - expected).norm() / expected.norm() < 0.02, name


def test_orthogonalise_moves_the_singular_values_near_one_and_keeps_the_singular_vectors():
    torch.manual_seed(0)
    for shape in ((3, 32, 32), (64, 16), (16, 64)):
        g = torch.randn(*shape)
        u, singular, vh = torch.linalg.svd(g, full_matrices=False)
        o = muon.orthogonalise(g)
        moved = u.mT @ o @ vh.mT  # diagonal: the same singular vectors, new singular values
        diagonal = torch.diagonal(moved, dim1=-2, dim2=-1)
        assert (moved - torch.diag_embed(diagonal)).abs().max() < 1e-4, shape
        # Near one, within the quintic's band, from all but the smallest singular values (a 32 x 32
        # Gaussian's least is ~0.01 of its largest: five iterations take it to ~0.45).
        assert diagonal.max() < 1.2 and (diagonal[..., : min(shape[-2:]) - 2] > 0.65).all(), shape
        assert (diagonal > 0.3).all(), shape


def test_muon_keeps_no_second_moment_for_its_matrices_and_updates_everything_else_as_adamw():
    cfg = dataclasses.replace(cfg_of("all"), zero_init_out=False)  # zero outputs: no gradient reaches qkv at first
    params = model.init(cfg, seed=0)
    batch = random_batch(cfg, 2, seed=0)
    runs = {}
    for opt in (ADAMW, MUON):
        step = model.make_train_step(cfg, opt, model.EAGER)
        runs[opt.kind] = step(params, model.optimizer_init(opt, params), batch, torch.tensor(1e-3))
    (adamw_params, adamw_state, _), (muon_params, muon_state, _) = runs["adamw"], runs["muon"]
    assert set(adamw_state) - set(muon_state) == {f"exp_avg_sq.{name}" for name in params if muon.takes(name)}
    for name in params:
        if muon.takes(name):
            assert not torch.allclose(muon_params[name], adamw_params[name]), name
        else:
            assert torch.equal(muon_params[name], adamw_params[name]), name


def test_muon_is_an_optimizer_kind():
    assert Muon().kind == "muon"
    with pytest.raises(ValueError, match="optimizer.kind='lion': allowed adamw, stable_adamw, muon"):
        optimizer_config("lion")


# --- one graph, no recompiles, compiled == eager ----------------------------------------------------


@pytest.mark.parametrize("switch", [*SWITCHES, "muon"])
def test_each_switch_is_one_graph_that_never_recompiles_and_matches_eager(switch):
    cfg, opt = (BASE, MUON) if switch == "muon" else (cfg_of(switch), ADAMW)
    explanation = torch._dynamo.explain(model.make_train_step(cfg, opt, model.EAGER))(
        *(lambda p: (p, model.optimizer_init(model.AdamW(), p)))(model.init(cfg, 0)),
        random_batch(cfg, 2, seed=0),
        torch.tensor(1e-3),
    )
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    runs = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for compiled in (False, True):
            params = model.init(cfg, seed=0)
            state = model.optimizer_init(model.AdamW(), params)
            step = model.make_train_step(cfg, opt, model.Compilation(compile=compiled, backend="aot_eager"))
            for i in range(3):
                params, state, metrics = step(params, state, random_batch(cfg, 4, seed=i), torch.tensor(1e-3 / (i + 1)))
            runs[compiled] = params, metrics["loss"]
    (eager, eager_loss), (compiled_params, compiled_loss) = runs[False], runs[True]
    assert torch.isfinite(eager_loss) and torch.allclose(compiled_loss, eager_loss, rtol=1e-5, atol=0)
    for name, p in eager.items():
        assert torch.allclose(compiled_params[name], p, rtol=0, atol=1e-5), name


def test_muons_apply_step_after_accumulation_is_one_graph_and_matches_the_train_step():
    params = model.init(BASE, seed=0)
    batch = random_batch(BASE, 4, seed=0)
    lr = torch.tensor(1e-3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        grads, _ = model.make_accumulate_step(BASE, AOT_EAGER)(params, bert_zeros(params), batch)
        applied, _, _ = model.make_apply_step(MUON, AOT_EAGER)(
            params, model.optimizer_init(model.AdamW(), params), grads, torch.tensor(1.0), lr
        )
    trained, _, _ = model.make_train_step(BASE, MUON, model.EAGER)(
        params, model.optimizer_init(model.AdamW(), params), batch, lr
    )
    for name, p in trained.items():
        assert torch.allclose(applied[name], p, rtol=0, atol=1e-6), name


def bert_zeros(params):
    return {name: torch.zeros_like(p) for name, p in params.items()}


# --- export ---------------------------------------------------------------------------------------


def test_a_layout_transformers_cannot_hold_names_the_switch_in_both_families():
    named = "pretrain.model.qk_norm=false"
    modernbert = dataclasses.replace(cfg_of("qk_norm"), head_transform=True, glu=True)
    bert_layout = dataclasses.replace(
        modernbert, position="learned", first_attn_norm=True, glu=False, post_norm=True, linear_bias=True
    )
    assert transformers_blockers(modernbert) == [named]
    assert transformers_blockers(bert_layout) == [named]
    # Zero-initialised projections are an init, not a layout: they export.
    assert transformers_blockers(dataclasses.replace(BASE, head_transform=True, zero_init_out=True)) == []


def test_export_to_transformers_refuses_the_switches_by_name_and_cram_format_keeps_them(tmp_path, sp_model):  # noqa: F811
    cfg = dataclasses.replace(MODERNBERT, qk_norm=True)
    run, params = fake_run(tmp_path, sp_model, cfg=cfg)
    result = CliRunner().invoke(cli.app, ["export", str(run), "--to", str(tmp_path / "hf"), "--format", "transformers"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "set pretrain.model.qk_norm=false" in result.output
    assert not (tmp_path / "hf").exists()
    loaded_cfg, loaded, _ = load_export(export(run, tmp_path / "cram"))
    assert loaded_cfg == cfg and loaded.keys() == params.keys()
    assert all(torch.equal(loaded[name], p) for name, p in params.items())


# --- the pretrain stage: canary, checkpoints and resume, continuing a checkpoint ---------------------

EVERY_SWITCH = pretrain.Architecture(
    hidden=32, layers=2, heads=2, intermediate=64, position="rope", qk_norm=True, zero_init_out=True,
)  # fmt: skip


@pytest.mark.slow
def test_every_switch_with_muon_passes_the_canary_checkpoints_and_resumes_bit_identical(pack, tmp_path, make_ctx):  # noqa: F811
    config = small(
        model=EVERY_SWITCH,
        optimizer=MUON,
        budget=pretrain.Budget(steps=6),
        batch_size=16,
        ramp=0.5,  # accumulation and apply steps too
        compile=True,
        backend="aot_eager",
        checkpoint_every_steps=2,
        keep_checkpoints=3,
    )
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight = pretrain.run(config, {"pack": pack}, straight_dir, make_ctx())
    assert straight["canary_diff"] is not None and straight["canary_diff"] < 1e-4
    assert straight["val_loss_end"] < straight["val_loss_start"]
    cfg = ModelConfig.from_json(straight_dir / "model.json")
    assert (cfg.qk_norm, cfg.zero_init_out) == (True, True)
    params, opt_state, _ = checkpoints.load(straight_dir / "checkpoints" / "step-2")
    assert (
        params.keys() == set(bert.shapes(cfg)) and opt_state.keys() == model.optimizer_init(model.Muon(), params).keys()
    )
    # A run stopped after step 2 (its checkpoint copied alone into a fresh folder) resumes from it.
    shutil.copytree(straight_dir / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2")
    resumed = pretrain.run(config, {"pack": pack}, resumed_dir, make_ctx())
    assert resumed["steps"] == 6 and resumed["final_loss"] == straight["final_loss"]
    assert same_tensors(resumed_dir / "params.safetensors", straight_dir / "params.safetensors")
    last = Path("checkpoints") / "step-6" / checkpoints.OPTIMIZER
    assert same_tensors(resumed_dir / last, straight_dir / last)


def test_a_switch_that_adds_parameters_is_refused_on_a_checkpoint_without_them(ws):  # noqa: F811
    result = cram("run", "pipeline.toml", "--set", "pretrain.model.qk_norm=true", "--dry-run")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error: pretrain.model.qk_norm: True contradicts the checkpoint's False")


def test_the_refusal_says_how_to_make_the_missing_weights(ws):  # noqa: F811
    result = cram("run", "pipeline.toml", "--set", "pretrain.model.qk_norm=true", "--dry-run")
    assert result.output.strip().endswith("leave it out, or set pretrain.init_switch_params = true to make its weights")
    with pytest.raises(ValueError, match="init_switch_params: true initialises the switches' parameters"):
        small(init_switch_params=True)


def test_init_switch_params_makes_the_weights_a_checkpoint_lacks_as_a_fresh_init_does(ws):  # noqa: F811
    # A zero budget: pretrain's output is the model training would start from.
    switches = ["pretrain.model.qk_norm=true", "pretrain.init_switch_params=true"]
    settings = [*switches, "pretrain.budget.steps=0", "pretrain.compile=false", "evaluate.tasks=[]"]
    result = cram("run", "pipeline.toml", *[arg for s in settings for arg in ("--set", s)])
    assert result.exit_code == 0, result.output
    out = Path("runs/base/pretrain")
    cfg = ModelConfig.from_json(out / "model.json")
    assert cfg.qk_norm
    params = checkpoints.read_tensors(out / "params.safetensors")
    assert params.keys() == set(bert.shapes(cfg))
    own, loaded = pretrained.load(pretrained.locate(Path("ckpt")))
    made = params.keys() - loaded.keys()
    assert made == {name for name in params if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(made) == 2 * own.layers  # a q and a k norm in every layer
    assert all(torch.all(params[name] == 1.0) for name in made)
    assert all(torch.equal(params[name], loaded[name]) for name in loaded if name in params)
    # Trained, after its own head is judged as the checkpoint is (without the switches it lacks).
    settings = [*switches, "pretrain.compile=false", "evaluate.tasks=[]"]
    result = cram("run", "pipeline.toml", "--name", "trained", *[arg for s in settings for arg in ("--set", s)])
    assert result.exit_code == 0, result.output
    figures = json.loads(Path("runs/trained/manifest.json").read_text())["stages"]["pretrain"]["outputs"]
    assert figures["steps"] == 2 and figures["init_head"].startswith("trained: loss")
