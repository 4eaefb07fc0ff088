"""bench/gpu.sh and bench/gpu_smoke.py, the first GPU window's command, on a CPU: each part under its own
limit, a failing part's log tail and the part after it, the overall deadline, and the scripts' CPU paths."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Stands in for python: step.py prints a row, gpu_smoke.py fails with 45 lines on stderr; anything else
# (the import check, the environment part) goes to the real interpreter.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
    bench/step.py) echo "| fake-row | $* |"; exit 0 ;;
    bench/gpu_smoke.py) for i in $(seq 0 44); do echo "smoke stderr $i" >&2; done; echo "smoke $*"; exit 3 ;;
    *) exec {python} "$@" ;;
esac
"""


def gpu_sh(tmp_path: Path, *flags: str, python: str = sys.executable, timeout: int = 120) -> tuple[int, str]:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHON": python},
    )
    assert (out / "report.md").read_text() in done.stdout + done.stderr  # the report is what it printed
    return done.returncode, done.stdout


def fake_python(tmp_path: Path) -> str:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    return str(fake)


def test_a_failing_part_shows_its_log_tail_and_the_next_part_runs(tmp_path):
    code, out = gpu_sh(tmp_path, "--parts", "smoke,pipeline,big", "--device", "cpu", python=fake_python(tmp_path))
    assert code == 0
    assert out.index("## smoke") < out.index("| fake-row | bench/step.py --device cpu") < out.index("## pipeline")
    assert "pipeline: failed (exit 3" in out
    tail = out.split("pipeline: failed (exit 3")[1].split("```")[1]
    assert tail.split() == [w for i in range(5, 45) for w in ("smoke", "stderr", str(i))]  # its last 40 lines
    assert "## pipeline-written" in out and "--attention written" in out  # the workaround, tried once
    assert "| fake-row | bench/step.py" in out.split("## big")[1]  # the part after the failures ran
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as packed:
        assert "./pipeline.stderr" in packed.getnames()


def test_parts_that_would_start_with_under_30_s_left_are_skipped(tmp_path):
    code, out = gpu_sh(tmp_path, "--seconds", "20", "--parts", "smoke,big", python=fake_python(tmp_path))
    assert code == 0 and "fake-row" not in out
    assert out.count("skipped: ") == 2 and "s left of the overall 20 s" in out


def test_an_unknown_part_is_refused(tmp_path):
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--out", str(tmp_path), "--parts", "smoke,warp"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "unknown part 'warp'" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the line for a machine without CUDA")
def test_gpu_smoke_without_cuda_says_so_and_exits_0():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_smoke.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "gpu_smoke: CUDA is not available here" in done.stdout


@pytest.mark.slow
def test_gpu_script_cpu_path_prints_the_smoke_rows(tmp_path):
    flags = ["--device", "cpu", "--big", "tiny", "--backend", "aot_eager", "--parts", "environment,smoke"]
    code, out = gpu_sh(tmp_path, *flags, "--", "--batch", "2", "--steps", "2", "--warmup", "0", timeout=300)
    assert code == 0 and "failed" not in out and "timed out" not in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"row", "cram-compiled", "cram-eager"}
    cram = [cell.strip() for cell in rows["cram-compiled"].split("|")[2:-1]]
    assert float(cram[1].replace(",", "")) > 0 and cram[5] != "-"  # tokens/s, compile cold


@pytest.mark.slow
def test_gpu_smoke_cpu_path_trains_and_names_the_sdpa_kernels():
    flags = ["--device", "cpu", "--backend", "aot_eager", "--microbatch", "2", "--steps", "6", "--attention", "sdpa"]
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_smoke.py"), *flags], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu_smoke: trained: steps 6," in done.stdout and "canary_diff 0.0" in done.stdout
    for label in ("no mask", "document mask"):
        assert f"gpu_smoke: SDPA, {label}: aten::_scaled_dot_product_flash_attention_for_cpu" in done.stdout
