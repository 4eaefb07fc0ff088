"""bench/gpu_profile.py on a CPU: the trace's tables from known events, a row skipped with its reason, the
deadline kept; and bench/profile_trace.py's categories, leaves and idle time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import profile_trace  # noqa: E402
from profile_trace import Event  # noqa: E402


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
        ("triton_tem_fused_mm_0", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
        ("triton_poi_fused__to_copy_add_native_layer_norm_3", "elementwise"),
        ("triton_red_fused_linalg_vector_norm_41", "optimizer"),
        ("triton_poi_fused_add_div_lerp_mul_sqrt_7", "optimizer"),
        ("graph_0_cpp_fused_add_gelu_mul_5", "elementwise"),
        ("graph_0_cpp_fused_linalg_vector_norm_native_layer_norm_backward_view_25", "elementwise"),
        ("graph_0_cpp_fused_add_clamp_div_lerp_mul_3", "optimizer"),
        ("aten::mm", "gemm"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_kernels_fall_in_their_category(name, kind):
    assert profile_trace.category(name) == kind


def test_a_cpu_trace_keeps_the_operators_that_call_no_other():
    outer, inner, sibling = Event("outer", 0, 10, 1), Event("aten::mm", 2, 3, 1), Event("aten::add", 6, 2, 1)
    other_thread = Event("aten::bmm", 1, 20, 2)
    assert set(profile_trace.leaves([outer, inner, sibling, other_thread])) == {inner, sibling, other_thread}


def test_busy_time_is_the_union_of_the_intervals():
    events = [Event("a", 0, 10), Event("b", 5, 10), Event("c", 30, 5), Event("d", 31, 1)]
    assert profile_trace.busy_us(events) == 20


def test_the_breakdown_of_two_steps_per_step():
    events = [Event("sm90_gemm", at, 3000) for at in (0, 5000)]
    events += [Event("triton_poi_fused_add_0", at, 1000) for at in (3000, 8000)]
    events += [Event("triton_poi_fused_lerp_1", 10_000, 1000)]
    found = profile_trace.breakdown(events, wall_s=0.020, steps=2)
    assert found["wall_ms"] == 10
    assert found["categories_ms"] == {"gemm": 3.0, "elementwise": 1.0, "optimizer": 0.5}
    assert found["busy_fraction"] == pytest.approx(0.45) and found["idle_fraction"] == pytest.approx(0.55)
    assert found["top"][0] == {"name": "sm90_gemm", "category": "gemm", "ms": 3.0, "calls": 1.0, "share": 0.3}
    assert found["kernels_per_step"] == 2.5


def test_a_chrome_trace_gives_cudas_kernels_and_a_cpus_leaf_operators():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 5, "tid": 7},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 5, "dur": 1, "tid": 7},
            {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 9, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 7, "tid": 1},
            {"ph": "i", "cat": "cpu_op", "name": "marker", "ts": 3, "tid": 1},
        ]
    }
    assert [e.name for e in profile_trace.device_events(trace, "cuda")] == ["gemm", "Memcpy HtoD"]
    assert [e.name for e in profile_trace.device_events(trace, "cpu")] == ["aten::mm"]


def profile(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_profile.py"), "--device", "cpu", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert (out / "report.md").read_text().strip() == done.stdout.strip()  # the report is what it printed
    return done, rows


def test_a_cuda_only_row_on_a_cpu_is_skipped_with_its_reason_and_the_run_goes_on(tmp_path):
    done, rows = profile(tmp_path, "--rows", "tiny-graphs", "--seconds", "100", "--backend", "aot_eager")
    assert done.returncode == 0, done.stderr
    assert rows == [{"row": "tiny-graphs", "skipped": "CUDA graphs replay on a CUDA device; this run's device is cpu"}]
    assert "tiny-graphs: skipped: CUDA graphs replay on a CUDA device" in done.stdout


def test_rows_that_would_start_past_the_deadline_are_skipped_and_it_ends_inside_it(tmp_path):
    done, rows = profile(tmp_path, "--rows", "floors,adamw", "--seconds", "3")
    assert done.returncode == 0
    assert [r["row"] for r in rows] == ["floors", "adamw"]
    assert all(r["skipped"].endswith("s left of the overall 3 s") for r in rows)


def test_an_unknown_row_is_refused():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_profile.py"), "--rows", "adamw,warp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown ['warp']" in done.stderr
