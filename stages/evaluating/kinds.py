"""The registry of task kinds: each `kind` of `[[evaluate.tasks]]` -> the Kind that runs it (stages/tasks/kind.py).
A new kind is its wing's module and one line in KINDS."""

from __future__ import annotations

from cram.stages.finetuning.kind import CLASSIFICATION
from cram.stages.retrieval.kind import RETRIEVAL
from cram.stages.tagging.kind import TAGGING
from cram.stages.tasks.kind import Kind

KINDS: tuple[Kind, ...] = (
    CLASSIFICATION,  # heldout-topic, glue, custom
    RETRIEVAL,  # retrieval, heldout-retrieval
    TAGGING,  # token-classification
)
BY_NAME: dict[str, Kind] = {name: kind for kind in KINDS for name in kind.kinds}


def of(name: str) -> Kind:
    """The Kind of the task kind `name`; KeyError for a name no kind serves (`Config` refuses one first)."""
    return BY_NAME[name]
