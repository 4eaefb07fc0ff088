"""A kept model's inputs as the fine-tuner, prediction and embedding give them: each text (or pair) as
one row of ids, rows padded to the smallest length bucket that holds the longest, so a compiled graph
is made once per bucket, and a graph run over rows sorted by length (`run_sorted`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np
    import torch

    Graph = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]  # (params, batch) -> outputs


def join(parts: tuple[list[int], ...], special: dict[str, int], max_length: int) -> np.ndarray:
    """[CLS] a [SEP] or [CLS] a [SEP] b [SEP], cut to `max_length` "longest first" (`longest_first`)."""
    import numpy as np

    budget = max_length - 1 - len(parts)
    if len(parts) == 1:
        a, b = parts[0][:budget], None
    else:
        a, b = parts
        keep_a, keep_b = longest_first(len(a), len(b), budget)
        a, b = a[:keep_a], b[:keep_b]
    row = [special["cls"], *a, special["sep"]] + ([] if b is None else [*b, special["sep"]])
    return np.asarray(row, dtype=np.int64)


def longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after cutting a pair to `budget` tokens as the fast tokenizer an export carries does
    (HF tokenizers' "longest_first"): the shorter text whole where the longer can take the rest, else both
    at half the budget, the longer (the second on ties) taking an odd budget's extra token."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if len_a <= len_b:
        keep_a = len_a if 2 * len_a <= budget else budget // 2
        return keep_a, budget - keep_a
    keep_b = len_b if 2 * len_b <= budget else budget // 2
    return budget - keep_b, keep_b


def bucket(length: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= length)


@dataclass(frozen=True)
class Padding:
    """How rows become a batch: the special ids, the length buckets, and whether the model reads BERT's
    token types (a pair's second text as segment 1). Buckets bound a compiled graph's shapes; eager steps
    have none to bound and give no buckets, `()`: each batch is padded to its longest row."""

    special: dict[str, int]
    buckets: tuple[int, ...]
    token_types: bool

    def inputs(
        self, rows: list[np.ndarray], lengths: np.ndarray, index: np.ndarray, size: int
    ) -> dict[str, np.ndarray]:
        """numpy `input_ids`, `attention_mask` (and `token_type_ids`) of `size` rows, padded to the bucket
        of the longest of `rows[index]` (no buckets: to that longest); rows past `len(index)` are fillers."""
        import numpy as np

        pad, cls, sep = self.special["pad"], self.special["cls"], self.special["sep"]
        longest = int(lengths[index].max())
        length = bucket(longest, self.buckets) if self.buckets else longest
        ids = np.full((size, length), pad, dtype=np.int64)
        ids[:, :2] = cls, sep  # fillers are [CLS] [SEP]: no row is all padding, which attention cannot take
        mask = np.zeros((size, length), dtype=bool)
        mask[:, :2] = True
        for row, i in enumerate(index):
            ids[row, : lengths[i]] = rows[i]
            mask[row, : lengths[i]] = True
        arrays = {"input_ids": ids, "attention_mask": mask}
        if self.token_types:  # BERT's segments: what follows the first [SEP] is the pair's second text
            is_sep = ids == sep
            arrays["token_type_ids"] = (((np.cumsum(is_sep, axis=1) - is_sep) > 0) & mask).astype(np.int64)
        return arrays


def run_sorted(
    graph: Graph,
    params: dict[str, torch.Tensor],
    rows: list[np.ndarray],
    padding: Padding,
    size: int,
    done: Callable[[int], None] | None = None,
) -> np.ndarray:
    """graph(params, batch) over `rows`, `size` rows a batch, similar lengths together (less padding),
    on the device of `params`: its fp32 outputs in the rows' order; `done(n)` after each batch of n rows
    (a progress bar). One graph per bucket; past dynamo's limit it would fall back to eager silently, so
    that is an error instead."""
    import numpy as np
    import torch

    from cram.stages.shared.device import to_device

    device = next(iter(params.values())).device
    lengths = np.array([len(r) for r in rows])
    # Longest first: the first batch holds the largest blocks, which the later, shorter ones reuse; and a batch
    # too large for the memory fails at once, not at the end of the file.
    order = np.argsort(-lengths, kind="stable")
    outputs = []
    limit = max(8, len(padding.buckets))
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        for start in range(0, len(rows), size):
            index = order[start : start + size]
            arrays = padding.inputs(rows, lengths, index, size)
            batch = {k: to_device(torch.from_numpy(v), device) for k, v in arrays.items()}
            outputs.append(graph(params, batch)[: len(index)])
            if done is not None:
                done(len(index))
    unsorted = np.empty_like(order)
    unsorted[order] = np.arange(len(order))
    return torch.cat(outputs).float().cpu().numpy()[unsorted]
