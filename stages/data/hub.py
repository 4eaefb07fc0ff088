"""The Hugging Face hub as a corpus source: whether it is reachable, and a dataset loaded from it
as an `IterableDataset` (streamed when online, from the local cache when offline)."""

from __future__ import annotations

import os
import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator
from urllib.parse import urlparse

from cram.stages import StageError

_PROBE_TIMEOUT_S = 2.0


def offline() -> bool:
    """Whether to treat the hub as offline. Offline, loading fails at once instead of retrying for
    ~25 s: unless the user said HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, a 2 s probe of the hub host
    decides, and when it fails the hub is put in offline mode, where a copy in the local cache still
    loads."""
    if _env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE"):
        return True
    if not _reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"  # later hub calls in this process fail fast too
        return True
    return False


def load(name: str, subset: str | None, split: str, offline: bool, where: str) -> Any:
    """A hub dataset as an `IterableDataset`: streamed when online; offline, the copy in the local
    cache (memory-mapped Arrow files), read in shards all the same. `where` names it in errors."""
    import datasets

    try:
        with _offline_mode(offline):
            if not offline:
                return datasets.load_dataset(name, subset, split=split, streaming=True)
            cached = datasets.load_dataset(name, subset, split=split)
            return cached.to_iterable_dataset(num_shards=max(1, min(64, len(cached))))
    except (ConnectionError, FileNotFoundError) as e:
        if offline:
            raise StageError(
                f"{where} is not in the local cache and the hub is offline (HF_HUB_OFFLINE=1 or no "
                f"network); download it once online, or use a local corpus ({type(e).__name__})"
            ) from None
        raise StageError(f"{where} could not be loaded: {e}") from None
    except ValueError as e:  # datasets' answer to an unknown subset or split
        raise StageError(f"{where}: {e}") from None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _reachable() -> bool:
    """A TCP connection to the hub host within 2 s. Run in a daemon thread because name
    resolution has no time-out of its own."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    answered, reached = threading.Event(), threading.Event()

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
            reached.set()
        except OSError:
            pass
        answered.set()

    threading.Thread(target=probe, daemon=True).start()
    answered.wait(_PROBE_TIMEOUT_S)
    return reached.is_set()


@contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """Offline mode for one load call. The libraries read HF_HUB_OFFLINE when first imported, so
    when they were imported before the probe their flags are switched too, and switched back."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
