"""Shared test set-up: offline hub, caches of the session's own, a seeded test order, torch seeded per
test, and a hand-made stage context."""

import os
import random
import socket

import pytest

# Every per-user cache a test could read or fill (matplotlib's font list, the hub and `datasets`, the
# inductor and Triton kernels, torch hub, wandb, rustup's settings): read warm, a test passes on our
# machines and fails on a fresh one, so each points into this session's pytest tmp dir and starts empty.
# One cache for the whole session, so a graph compiled once is reused by the tests after it.
_CACHES = {
    "XDG_CACHE_HOME": "xdg-cache",
    "XDG_CONFIG_HOME": "xdg-config",
    "MPLCONFIGDIR": "matplotlib",
    "HF_HOME": "hf",
    "HF_HUB_CACHE": "hf/hub",
    "HF_DATASETS_CACHE": "hf/datasets",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "TORCH_HOME": "torch",
    "WANDB_DIR": "wandb",
    "WANDB_CACHE_DIR": "wandb/cache",
    "WANDB_CONFIG_DIR": "wandb/config",
    "WANDB_DATA_DIR": "wandb/data",
    "RUSTUP_HOME": "rustup",  # pip runs `rustc --version` for its user agent; rustup's proxy writes ~/.rustup
}
SHUFFLE = "CRAM_TEST_SHUFFLE"  # an integer seed: run the collected tests in an order shuffled by it


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path set-up, before any test module imports torch
def pytest_configure(config: pytest.Config) -> None:
    caches = config._tmp_path_factory.mktemp("caches", numbered=False)
    for variable, folder in _CACHES.items():
        (caches / folder).mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(caches / folder)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # The CLI's console fixes its width at import when COLUMNS is set (xdist's workers get COLUMNS=80):
    # the tests that read wide tables then could not widen it per call (`env={"COLUMNS": ...}`).
    for variable in ("COLUMNS", "LINES"):
        os.environ.pop(variable, None)
    # Under pytest-xdist (the README's `-n auto`: a worker per core) each worker gets its share of the
    # cores: every worker on torch's default of one thread per core would oversubscribe the machine.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Shuffle the modules, then the tests within each (as pytest-randomly does): a module-scoped
    fixture, such as test_bad_inputs' finished run, is then still made once per module."""
    seed = os.environ.get(SHUFFLE)
    if not seed:
        return
    rng = random.Random(int(seed))
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


def pytest_report_header(config: pytest.Config) -> str:
    seed = os.environ.get(SHUFFLE)
    return f"test order shuffled with {SHUFFLE}={seed}" if seed else f"test order as collected ({SHUFFLE} unset)"


@pytest.fixture(autouse=True)
def seeded_torch():
    """Torch's global generator seeded afresh for every test: a test's draws (`torch.randn_like` of a
    perturbed init) then do not depend on which tests its worker ran before it, nor on their order."""
    import torch

    torch.manual_seed(0)


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
def plain_machine(monkeypatch):
    """A CPU-only machine with 64 GiB of RAM, for tests of a config's checks rather than of this machine:
    `device = "auto"` resolves to the CPU and the memory check passes for any config the tests ship."""
    import torch

    from cram.stages.shared import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "memory_bytes", lambda _device: 64 * 2**30)


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


@pytest.fixture
def default_csv_field_limit():
    """csv's default field limit (128 KiB) while the test runs: the limit is per process, and a file read
    earlier in it may have raised it already."""
    import csv

    before = csv.field_size_limit(131072)
    yield
    csv.field_size_limit(before)
