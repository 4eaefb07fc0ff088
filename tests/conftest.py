"""Shared test set-up: offline hub, isolated caches, and a hand-made stage context."""

import os
import socket
import tempfile
from pathlib import Path

import pytest

# Isolation for the whole session, set before torch or datasets are imported by any test: no hub
# access, and caches in one temporary folder (shared by the tests, so a graph compiled once is reused).
_CACHE = Path(tempfile.mkdtemp(prefix="cram-test-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["HF_HOME"] = str(_CACHE / "hf")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_CACHE / "inductor")


@pytest.fixture
def make_ctx(tmp_path):
    """Build a `stages.Context` for calling a stage's `run` directly, without the runner."""
    import structlog

    from cram.stages import Context

    def make(seed: int = 0, device: str = "cpu", **kw) -> Context:
        run_dir = tmp_path / "run"
        run_dir.mkdir(exist_ok=True)
        return Context(seed=seed, device=device, run_dir=run_dir, log=structlog.get_logger(), **kw)

    return make


@pytest.fixture
def one_thread():
    """For tests of tiny models: one thread is faster than two for tensors this small, and on a busy
    machine every parallel region waits for a descheduled thread (1 ms steps took 450 ms)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def free_port():
    """A TCP port free now on the loopback, for a torchrun rendezvous: a fixed one clashes with any other
    job on the machine that uses it (seen as a rank aborting)."""

    def find() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return find
