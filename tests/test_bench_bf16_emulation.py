"""bench/bf16_emulation.py: a train step under bf16 autocast with the emulated matrix products gives
native bf16's loss and gradient norm (up to the order of the sums), not fp32's: so quality.py's bf16 rows
on a CPU without bf16 units measure bf16."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from cram import model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bf16_emulation import Bf16Matmuls  # noqa: E402

CFG = dataclasses.replace(model.PRESETS["tiny"], vocab_size=1024, hidden=64, heads=2, intermediate=256, layers=2)


def _one_step(autocast: torch.dtype | None, emulated: bool) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, CFG.vocab_size, (8, 64), dtype=torch.int32, generator=generator)
    positions = torch.randperm(ids.numel(), generator=generator)[:200].sort().values
    batch = {"input_ids": ids, "mlm_positions": positions, "mlm_labels": ids.flatten()[positions].long()}
    params = model.init(CFG, seed=0)
    step = model.make_train_step(CFG, model.AdamW(), model.Compilation(compile=False, autocast=autocast))
    with Bf16Matmuls() if emulated else contextlib.nullcontext():
        _, _, metrics = step(params, model.optimizer_init(model.AdamW(), params), batch, torch.tensor(1e-3))
    return {key: metrics[key].item() for key in ("loss", "grad_norm")}


def test_emulated_bf16_matches_native_bf16_and_not_fp32():
    native = _one_step(torch.bfloat16, emulated=False)
    emulated = _one_step(torch.bfloat16, emulated=True)
    fp32 = _one_step(None, emulated=False)
    for key in ("loss", "grad_norm"):
        assert emulated[key] == pytest.approx(native[key], rel=2e-5), (key, emulated, native)
    # the gradient norm tells bf16 from fp32 apart (1.9e-3 here; the loss, a mean over rows, by 4e-6)
    assert fp32["grad_norm"] != pytest.approx(native["grad_norm"], rel=2e-4), (fp32, native)


def test_only_bf16_products_change():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with Bf16Matmuls():
        assert torch.equal(a @ b, torch.mm(a, b))  # fp32 passes through
        product = a.bfloat16() @ b.bfloat16()
    assert product.dtype == torch.bfloat16
    assert torch.equal(product, (a.bfloat16().float() @ b.bfloat16().float()).bfloat16())
