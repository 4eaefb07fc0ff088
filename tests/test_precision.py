"""The precision a stage computes in: the candidates of each setting, the canary's choice among them,
and, on this machine's CPU, inductor's compiled bf16 step against eager for every encoder layout (the
stages' fallbacks: tests/test_pretrain.py and tests/test_evaluate.py)."""

import dataclasses
import math
import warnings

import pytest
import torch
from test_step import LAYOUTS as STEP_LAYOUTS
from test_step import TINIEST, TINY, random_batch

from cram import model
from cram.stages.shared import device as devices
from cram.stages.shared import precision
from cram.stages.shared.precision import BF16, BF16_256, FP32, CanaryError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
NAN = float("nan")


@pytest.mark.parametrize(
    "setting, device, backend, native, expected",
    [
        ("fp32", CPU, "inductor", True, [FP32]),
        ("auto", CPU, "inductor", False, [FP32]),
        ("auto", CPU, "inductor", True, [BF16, BF16_256, FP32]),
        ("auto", CPU, "aot_eager", True, [BF16, FP32]),  # the vector width is inductor's
        ("auto", CUDA, "inductor", False, [BF16, FP32]),  # CPU code generation is not CUDA's
        ("bf16", CPU, "inductor", False, [BF16, BF16_256]),  # never fp32 when bf16 is asked for
        ("bf16", CPU, "aot_eager", True, [BF16]),
    ],
)
def test_candidates_fastest_first(monkeypatch, setting, device, backend, native, expected):
    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: native)
    monkeypatch.setattr(devices, "use_tf32", lambda allowed=True: None)  # CUDA's choice sets it, process-wide
    assert precision.candidates(setting, device, backend, compiled=True) == expected


def test_the_256_bit_candidate_patches_inductor_for_its_graphs_only():
    assert BF16.compile_options() is None and FP32.compile_options() is None
    assert BF16_256.compile_options() == {"cpp.simdlen": 256}
    assert (BF16.autocast(), BF16_256.autocast(), FP32.autocast()) == (torch.bfloat16, torch.bfloat16, None)


class Log:
    def __init__(self):
        self.warnings, self.infos = [], []

    def warning(self, message):
        self.warnings.append(message)

    def info(self, event, **fields):
        self.infos.append((event, fields))


def choose(setting, diffs, native=True, backend="inductor", stage="pretrain", keys="pretrain", world_size=1):
    """`precision.choose` with a canary that reads each candidate's difference from `diffs` (an exception
    there is raised, as a compile that fails raises)."""
    tried, log = [], Log()

    def check(candidate):
        tried.append(candidate)
        if isinstance(diffs[candidate], Exception):
            raise diffs[candidate]
        return diffs[candidate]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(devices, "native_cpu_bf16", lambda: native)
        canary = precision.Canary(check, 0.02, keys, world_size)
        choice = precision.choose(setting, CPU, backend, canary, log, stage)
    return choice, tried, log.warnings


def test_auto_keeps_bf16_when_its_canary_passes_and_says_nothing():
    choice, tried, warned = choose("auto", {BF16: 3e-4})
    assert (choice.precision, tried, warned, choice.canary_diff) == (BF16, [BF16], [], 3e-4)
    assert choice.reason == "auto: bf16, which this CPU multiplies natively; compile canary 0.0003"


def test_auto_falls_back_to_256_bit_code_then_to_fp32_with_one_warning():
    choice, tried, warned = choose("auto", {BF16: math.inf, BF16_256: 1e-4})
    assert (choice.precision, tried) == (BF16_256, [BF16, BF16_256])
    assert len(warned) == 1 and "bf16 by inf" in warned[0] and "bf16 with 256-bit vector code" in warned[0]

    choice, tried, warned = choose("auto", {BF16: math.inf, BF16_256: 0.5, FP32: 1e-5})
    assert (choice.precision, tried) == (FP32, [BF16, BF16_256, FP32])
    assert len(warned) == 1 and warned[0].endswith("computing in fp32")
    assert "bf16 by inf, bf16 with 256-bit vector code by 0.5" in choice.reason
    assert "fp32 passed it (1e-05)" in choice.reason


def test_an_explicit_bf16_never_becomes_fp32_and_the_error_names_the_choices():
    with pytest.raises(CanaryError) as e:
        choose("bf16", {BF16: math.inf, BF16_256: 0.03})
    message = str(e.value)
    assert "differs from eager by inf in bf16, by 0.03 in bf16 with 256-bit vector code" in message
    assert 'pretrain.precision = "auto"' in message and '"fp32"' in message and "nothing was trained" in message


def test_a_canary_at_the_tolerance_passes_and_nan_fails():
    assert choose("fp32", {FP32: 0.02})[0].precision == FP32
    with pytest.raises(CanaryError, match="by nan in fp32"):
        choose("fp32", {FP32: NAN})


def test_under_auto_a_candidate_that_fails_to_compile_is_a_failed_candidate_and_the_reason_says_why():
    inductor = RuntimeError("C++ compile error\n/tmp/torchinductor/ab.cpp:12: error: ...")
    choice, tried, warned = choose("auto", {BF16: inductor, BF16_256: 1e-4})
    assert (choice.precision, tried, choice.canary_diff) == (BF16_256, [BF16, BF16_256], 1e-4)
    assert choice.reason == (
        "bf16 failed to compile or run (RuntimeError: C++ compile error); "
        "bf16 with 256-bit vector code passed it (0.0001)"
    )
    assert len(warned) == 1 and warned[0].endswith("computing in bf16 with 256-bit vector code")
    choice, tried, _ = choose("auto", {BF16: math.inf, BF16_256: inductor, FP32: 0.0})
    assert choice.precision == FP32 and choice.reason.startswith(
        "the compiled step differs from eager beyond canary_tolerance 0.02 in bf16 by inf; "
        "bf16 with 256-bit vector code failed to compile or run (RuntimeError: C++ compile error)"
    )


def test_an_explicit_precision_that_fails_to_compile_stops_with_the_error_and_the_keys_that_exist():
    inductor = RuntimeError("C++ compile error")
    with pytest.raises(CanaryError) as e:
        choose("bf16", {BF16: inductor, BF16_256: 0.5}, stage="baseline", keys="evaluate")
    assert str(e.value) == (
        "baseline: compile canary: the compiled step (inductor) differs from eager by 0.5 in bf16 with 256-bit "
        "vector code (relative), above canary_tolerance 0.02; bf16 failed to compile or run (RuntimeError: C++ "
        'compile error); nothing was trained. Try evaluate.precision = "auto" (which falls back to fp32) or '
        '"fp32", another evaluate.backend, evaluate.compile = false, or evaluate.canary_steps = 0 to train anyway'
    )
    with pytest.raises(CanaryError, match=r"^pretrain: compile canary: fp32 failed to compile or run \(MemoryError"):
        choose("fp32", {FP32: MemoryError()})


def test_bad_input_in_a_canary_is_no_failed_candidate():
    from cram.stages import StageError

    with pytest.raises(StageError, match="a bad task file"):
        choose("auto", {BF16: StageError("a bad task file"), BF16_256: 0.0, FP32: 0.0})


def test_the_ranks_agree_on_the_worst_difference_and_the_first_error(monkeypatch):
    from cram.stages.shared import collectives

    others = {
        BF16: (precision.Difference(0.5), None),
        BF16_256: (precision.Difference(0.0), "RuntimeError: rank 1 failed"),
        FP32: (precision.Difference(0.0), None),
    }
    gathered = []

    def all_gather(obj, world_size):
        gathered.append(obj)
        return [obj, others[[BF16, BF16_256, FP32][len(gathered) - 1]]]

    monkeypatch.setattr(collectives, "all_gather", all_gather)
    choice, tried, _ = choose("auto", {BF16: 1e-4, BF16_256: 1e-4, FP32: 1e-5}, world_size=2)
    assert choice.precision == FP32 and tried == [BF16, BF16_256, FP32] and choice.canary_diff == 1e-5
    assert "bf16 by 0.5" in choice.reason and "(RuntimeError: rank 1 failed)" in choice.reason


def wrong_in_bf16(real, also_at_256: bool):
    """A step factory like `real` whose compiled bf16 steps return a NaN gradient norm (the miscompile
    measured on an AMX Xeon), also with 256-bit vector code when `also_at_256`; nothing compiles."""

    def make(*args, **kw):
        *args, how = args
        step = real(*args, how.eager(), **kw)
        if not (how.compile and how.autocast == torch.bfloat16 and (how.options is None or also_at_256)):
            return step

        def wrong(*inputs):
            *state, metrics = step(*inputs)
            return (*state, {**metrics, "grad_norm": metrics["grad_norm"] * NAN})

        return wrong

    return make


# --- inductor's compiled bf16 step on this machine -------------------------------------------------

LAYOUTS = {"default preset": {}, **STEP_LAYOUTS}
TOLERANCE = 0.02  # the canary's default: bf16 rounding moves loss and gradient norm by ~1e-3 here


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not devices.native_cpu_bf16(), reason="bf16 is emulated on this CPU: auto computes in fp32")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_inductor_bf16_train_step_equals_eager_in_the_precision_auto_chooses(layout):
    """Each layout's train step compiled by inductor in bf16 against the same step run eagerly in bf16.
    Where inductor's own (512-bit) vector code is wrong, `auto` falls back to 256-bit code: that one must
    be right (the test warns that the fault is here); neither right fails."""
    cfg = TINY if layout == "default preset" else dataclasses.replace(TINIEST, **LAYOUTS[layout])
    batch = random_batch(cfg, 8, seed=0)
    if layout == "document_ids":
        batch["document_ids"] = (torch.arange(cfg.max_seq_len) >= 5).long().expand(8, -1).contiguous()
    params = model.init(cfg, 0)
    start = (params, model.optimizer_init(model.AdamW(), params))
    opt, lr = model.AdamW(), torch.tensor(1e-3)
    eager = model.make_train_step(cfg, opt, model.Compilation(compile=False, autocast=torch.bfloat16))
    expected = eager(*start, batch, lr)[2]

    def diff(candidate):
        step = model.make_train_step(
            cfg, opt, model.Compilation(autocast=torch.bfloat16, options=candidate.compile_options())
        )
        got = step(*start, batch, lr)[2]
        worst = max(float((got[k] - expected[k]).abs() / expected[k].abs()) for k in ("loss", "grad_norm"))
        return worst if math.isfinite(worst) else math.inf

    first = diff(BF16)
    if first <= TOLERANCE:
        return
    fallback = diff(BF16_256)
    warnings.warn(f"{layout}: inductor's bf16 step differs from eager by {first:.3g}; with 256-bit code {fallback:.3g}")
    assert fallback <= TOLERANCE, (
        f"{layout}: compiled bf16 differs from eager by {first:.3g}, at 256 bits {fallback:.3g}"
    )


def test_the_pretrain_canary_reads_accuracy_as_a_fraction_and_loss_and_grad_norm_relatively():
    from cram.stages.pretraining.loop import step_difference

    eager = torch.tensor([9.03, 36 / 5200, 1.5])  # an untrained model: 36 of 5,200 masked tokens right
    flipped = torch.tensor([9.03, 35 / 5200, 1.5])  # one near-tie flipped by bf16 rounding
    assert step_difference(flipped, eager) == pytest.approx(1 / 5200, rel=1e-4)  # relatively it would be 1/36 > 0.02
    assert step_difference(torch.tensor([9.03 * 1.03, 36 / 5200, 1.5]), eager) == pytest.approx(0.03, rel=1e-4)
    assert step_difference(torch.tensor([9.03, 36 / 5200, 1.5 * 0.9]), eager) == pytest.approx(0.1, rel=1e-4)
    assert step_difference(torch.tensor([9.03, 0.2, 1.5]), eager) > 0.19  # a wrong step's accuracy
    assert step_difference(torch.tensor([float("nan"), 0.0, 1.5]), eager) == float("inf")
