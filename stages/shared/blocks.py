"""Pack's blocks as the later stages read them: at any length, and by document.

Pack cuts one stream of documents into blocks and drops only the last partial one, so blocks of any
length are a reshape of the same tokens (`blocks_of`): sequence-length phases and a held-out loss at
several lengths need no second pack.

Attention within documents needs each token's document. Pack joins documents with boundary tokens:
with `boundary = "cls-sep"` each document starts with [CLS], with `"sep"` each ends with [SEP]. A
block's document ids count the boundaries before a token, read from the ids before masking (a masked
[CLS] still starts its document).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


def blocks_of(blocks: np.ndarray, seq_len: int) -> np.ndarray:
    """Pack's blocks [n, S] as blocks of `seq_len` (a view: a memory map stays unread). The tokens past
    the last whole block are left out."""
    flat = blocks.reshape(-1)
    return flat[: len(flat) // seq_len * seq_len].reshape(-1, seq_len)


@dataclass(frozen=True)
class Boundary:
    token: int  # the boundary token's id
    starts: bool  # True: it starts a document ([CLS]); False: it ends one ([SEP])


def boundary(pack_boundary: str, special: dict[str, int]) -> Boundary:
    """The token that separates documents in pack's blocks, from pack's `boundary` setting."""
    return Boundary(special["cls"], True) if pack_boundary == "cls-sep" else Boundary(special["sep"], False)


def document_ids(ids: torch.Tensor, at: Boundary) -> torch.Tensor:
    """[B, S] int32, counting up along each block: tokens share an id when they share a document."""
    import torch

    marks = (ids == at.token).to(torch.int32)
    counted = marks.cumsum(dim=1, dtype=torch.int32)
    return counted if at.starts else counted - marks  # a closing [SEP] belongs to the document it ends
