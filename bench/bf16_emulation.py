"""bf16 autocast's arithmetic on a CPU that has no bf16 units, at fp32 speed, for losses at equal tokens.

    with Bf16Matmuls():
        loss = step(batch)   # under torch.autocast(dtype=torch.bfloat16), eager

Where a CPU lacks AVX512-BF16 and AMX, torch multiplies bf16 matrices in a reference loop 30 to 100 times
slower than fp32 (tiny preset: 3.6 s a step against 0.26 s), too slow to train a model for a quality
figure. Autocast still decides which ops run in bf16; this mode only changes how a bf16 matrix product is
computed: its bf16 operands are widened to fp32 (exact), multiplied and summed in fp32, and the result is
rounded to bf16. That is what bf16 hardware does (the products of two 8-bit mantissas are exact in fp32,
the sums are fp32, the output is rounded), so the losses match native bf16 up to the order of the sums
(tests/test_bench_bf16_emulation.py). It times nothing: a speed figure must come from real bf16 units.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cram.stages.shared.device import native_cpu_bf16

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class Bf16Matmuls(TorchDispatchMode):
    """Every bf16 matrix product (what linear layers, attention written out and their gradients lower to)
    computed in fp32 and rounded to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS and any(_is_bf16(a) for a in args):
            wide = [a.float() if _is_bf16(a) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def needed(device: torch.device) -> bool:
    """Whether bf16 training on `device` has to be emulated to finish: a CPU without bf16 units."""
    return device.type == "cpu" and not native_cpu_bf16()


def _is_bf16(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16
