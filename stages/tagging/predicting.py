"""A kept tagger run on texts (`cram predict`): each text's entities with their character offsets, as
transformers' `pipeline("token-classification", aggregation_strategy="first")` finds them on the export.

A text is encoded whole by the export's fast tokenizer (`kept_tokenizer`: the same ids and offsets); its tokens
are grouped into words as that pipeline groups them (a WordPiece continuation `##` joins the word before it; a
tokenizer without such a prefix joins a token that no space precedes or starts); each word is tagged by its
first token, read from the window where it has the most context when the text is longer than the tagger's
max_length (windows.py); the words' tags become entities as conlleval reads IOB2 (an I- that continues nothing
starts one), each with the mean of its words' probabilities, its span without outer whitespace (the pipeline's
keeps the space a byte-level or sentencepiece token's offsets begin with). One row a text:

    {"entities": [{"type": "person", "start": 0, "end": 9, "text": "Ann Smith", "score": 0.98}, ...]}

transformers' `aggregation_strategy="simple"` reads every sub-token's own tag, also of the tokens after a word's
first, which no fine-tune trained (they are outside the loss): it finds the same entities where each word of
them is one token, and may cut an entity inside a word otherwise (docs/tagging.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from cram.stages.kept.batches import Padding
from cram.stages.kept.fast_tokenizer import kept_tokenizer
from cram.stages.kept.folder import KeptClassifier
from cram.stages.tagging.tuning import read_positions
from cram.stages.tagging.windows import windowed

if TYPE_CHECKING:
    import torch

    from cram.stages.kept.predicting import Settings

Word = tuple[int, float, int, int]  # (tag id, probability, first character, last character + 1)


@dataclass(frozen=True)
class Text:
    """A text and its words' tags."""

    text: str
    words: list[Word]


@dataclass(frozen=True)
class TagPredictor:
    """A tagger ready to predict: its params on the device, the export's fast tokenizer, the prediction graph.
    `predict_files` (stages/kept/predicting.py) runs it as it runs a classifier, a chunk of texts at a time."""

    classifier: KeptClassifier
    fast: Any  # tokenizers.Tokenizer
    padding: Padding
    params: dict[str, torch.Tensor]
    graph: Callable
    settings: Settings

    @classmethod
    def make(
        cls, classifier: KeptClassifier, tokenizer: Path, special: dict[str, int], settings: Settings
    ) -> TagPredictor:
        """KeptError naming the tokenizer file where it cannot be read. It computes in fp32: on CUDA, not TF32."""
        from cram.model.step import Compilation
        from cram.model.tagger import make_tag_eval_step
        from cram.stages.shared import device as devices

        fast = kept_tokenizer(tokenizer, special)
        fast.no_truncation()
        fast.no_padding()
        cfg = dataclasses.replace(classifier.cfg, dropout=0.0)
        how = Compilation(compile=settings.compile, backend=settings.backend)
        graph = make_tag_eval_step(cfg, how, head=classifier.meta["head"])
        device = devices.resolve("auto")
        if device.type == "cuda":
            devices.use_tf32(False)
        params = {k: v.to(device) for k, v in classifier.params().items()}
        buckets = tuple(classifier.meta["buckets"]) if settings.compile else ()
        return cls(classifier, fast, Padding(special, buckets, cfg.token_types > 1), params, graph, settings)

    def outputs(self, texts: list[tuple[str, ...]]) -> list[Text]:
        """Each text's words and their tags, in the texts' order."""
        encodings = self.fast.encode_batch([t[0] for t in texts], add_special_tokens=False)
        grouped = [self.words(t[0], e) for t, e in zip(texts, encodings)]
        pieces = [[e.ids[i] for i in word] for e, words in zip(encodings, grouped) for word in words]
        counts = [len(words) for words in grouped]
        rows = windowed(pieces, counts, None, self.padding.special, self.classifier.meta["max_length"])
        tags, chances = read_positions(self.graph, self.params, rows, self.padding, self.settings.batch_size)
        found = []
        for (text,), encoding, words, reads in zip(texts, encodings, grouped, rows.reads):
            offsets = encoding.offsets
            found.append(
                Text(
                    text,
                    [
                        (int(tags[r, p]), float(chances[r, p]), offsets[w[0]][0], offsets[w[-1]][1])
                        for w, (r, p) in zip(words, reads)
                    ],
                )
            )
        return found

    def words(self, text: str, encoding: Any) -> list[list[int]]:
        """The encoding's tokens grouped into words as transformers' token-classification pipeline groups them."""
        prefix = getattr(self.fast.model, "continuing_subword_prefix", None)
        unknown = self.padding.special.get("unk")
        words: list[list[int]] = []
        for i, (token, (start, end)) in enumerate(zip(encoding.tokens, encoding.offsets)):
            if prefix:
                joins = len(token) != len(text[start:end])
            else:
                joins = start > 0 and " " not in text[start - 1 : start + 1]
            if words and joins and encoding.ids[i] != unknown:
                words[-1].append(i)
            else:
                words.append([i])
        return words

    def rows(self, outputs: list[Text]) -> list[dict[str, Any]]:
        """One row a text: its entities."""
        return [{"entities": entities(o.text, o.words, self.classifier.labels)} for o in outputs]


def entities(text: str, words: list[Word], labels: list[str]) -> list[dict[str, Any]]:
    """The entities of a text's tagged words: a run of words of one type, each new B- starting another (an I- of
    another type, or after O, starts one too); O words are none. A span's outer whitespace is left out (a
    byte-level or sentencepiece token's offsets hold the space before it), and a span of whitespace alone
    is none."""
    runs: list[tuple[str, list[Word]]] = []
    for word in words:
        label = labels[word[0]]
        prefix, kind = ("B", None) if label == "O" else (label[0], label[2:])
        if runs and prefix == "I" and runs[-1][0] == kind:
            runs[-1][1].append(word)
        else:
            runs.append((kind, [word]))
    found = []
    for kind, span in runs:
        start, end = trimmed(text, span[0][2], span[-1][3])
        if kind is not None and start < end:
            score = round(float(np.mean([w[1] for w in span])), 6)
            found.append({"type": kind, "start": start, "end": end, "text": text[start:end], "score": score})
    return found


def trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    """[start, end) without the whitespace at either end of text[start:end]."""
    piece = text[start:end]
    lead = len(piece) - len(piece.lstrip())
    return start + lead, max(start + lead, end - (len(piece) - len(piece.rstrip())))
