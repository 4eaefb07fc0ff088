"""Small stages for testing the runner without torch: alpha -> beta -> gamma.

Each adds its `value` to the totals of its upstream stages and appends its name to
`RUN_DIR/calls.log`, so a test can see which stages ran. `fail` makes a stage fail on purpose;
the environment variables FAKE_HANG=<stage>, FAKE_SLOW=<stage> and FAKE_INTERRUPT=<stage> make that stage
hang, take 3 s, or act as if Ctrl-C were pressed, after writing part of its output (without changing
the stage's key).
"""

from __future__ import annotations

import json
import logging
import os
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cram.stages import StageError

PIPELINE = """
[run]
name = "t"
seed = 1
root = "{root}"
device = "cpu"

[alpha]
value = 1

[beta]
value = 10

[gamma]
value = 100
"""


@dataclass(frozen=True)
class Config:
    value: int = 1
    # validate: rejected by the stage's `validate`; sdpa: a crash inside SDPA's kernel, as torch reports one
    fail: Literal["", "input", "crash", "validate", "sdpa"] = ""
    tags: tuple[str, ...] = ()


def validate(config: Config, pipeline) -> None:
    if config.fail == "validate":
        raise StageError(f"value: {config.value} is refused before any stage runs")


def _make(name: str, upstream: tuple[str, ...], resumable: bool = False, distributed: bool = False):
    def run(config: Config, inputs: dict, out_dir: Path, ctx) -> dict:
        with open(ctx.run_dir / "calls.log", "a") as f:
            f.write(f"{name}@{ctx.rank}\n" if distributed else f"{name}\n")
        if distributed:  # proves the process group is up on every rank
            import torch
            import torch.distributed as dist

            ranks = torch.tensor([1.0])
            dist.all_reduce(ranks)
            assert int(ranks) == ctx.world_size
        total = config.value + sum(up.outputs["total"] for up in inputs.values())
        attempts = out_dir / "attempts"
        if ctx.rank == 0:  # ranks share the output folder: only rank 0 writes to it, as real stages do
            attempts.write_text(str(int(attempts.read_text()) + 1 if attempts.exists() else 1))
        if os.environ.get("FAKE_HANG") == name:
            time.sleep(120)
        if os.environ.get("FAKE_SLOW") == name:
            time.sleep(3)
        if os.environ.get("FAKE_INTERRUPT") == name:
            raise KeyboardInterrupt  # what Ctrl-C raises
        if config.fail == "input":
            raise StageError(f"[{name}] value: {config.value} is not allowed here")
        if config.fail == "crash":
            raise RuntimeError("boom")
        if config.fail == "sdpa":
            raise RuntimeError("aten._scaled_dot_product_efficient_attention_backward: invalid configuration")
        if ctx.rank == 0:
            (out_dir / "result.json").write_text(json.dumps({"total": total}))
        ctx.log.info("computed", total=total)
        logging.getLogger("thirdparty").info("library chatter from %s", name)
        logging.getLogger("thirdparty").warning("a standard-library record from %s", name)
        return {"result": "result.json", "total": total, "attempts": int(attempts.read_text()) if ctx.rank == 0 else 0}

    module = types.ModuleType(f"fake_{name}")
    module.NAME, module.VERSION, module.UPSTREAM, module.RESUMABLE = name, "1", upstream, resumable
    module.DISTRIBUTED = distributed
    if not upstream:  # the first stage reads a file outside the run, as tokenize reads a corpus
        module.fingerprint = lambda config: Path("input.txt").read_text() if Path("input.txt").exists() else None
    module.Config, module.run, module.validate = Config, run, validate
    return module


def modules(resumable_beta: bool = False, distributed_beta: bool = False) -> list[types.ModuleType]:
    return [
        _make("alpha", ()),
        _make("beta", ("alpha",), resumable_beta, distributed_beta),
        _make("gamma", ("beta",)),
    ]
