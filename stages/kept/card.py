"""The README.md of an export: how to load it, the run's figures per stage and its resolved config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cram.stages.kept.folder import KeptEmbedder
from cram.stages.shared.figures import is_number


@dataclass(frozen=True)
class Card:
    """What a model card says of the run an export comes from."""

    run: str  # the run's name
    figures: dict[str, dict[str, Any]]  # stage -> its outputs (the numbers are quoted)
    config: str  # the run's resolved config, TOML


def model_card(card: Card, fmt: str, task: str | None = None, embedder: KeptEmbedder | None = None) -> str:
    """README.md of an export of `card`'s run in format `fmt` (with `task`, its kept classifier, or its
    kept `embedder`)."""
    lines = [
        f"# {card.run}",
        "",
        f"A BERT-style masked language model crammed by `cram` (run `{card.run}`), exported in the `{fmt}` format."
        if task is None
        else f"The `{task}` {'classifier' if embedder is None else 'embedding model'} fine-tuned by `cram` "
        f"(run `{card.run}`), exported in the `{fmt}` format.",
        "",
        "```python",
        _usage(fmt, task) if embedder is None else _embedder_usage(fmt, embedder),
        "```",
        "",
        "## Figures",
        "",
    ]
    for stage, outputs in card.figures.items():
        figures = {k: v for k, v in outputs.items() if is_number(v)}
        if figures:
            lines += [
                f"**{stage}**: "
                + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()),
                "",
            ]
    lines += ["## Config", "", "```toml", card.config.strip(), "```", ""]
    return "\n".join(lines)


def _embedder_usage(fmt: str, embedder: KeptEmbedder) -> str:
    documents, queries = embedder.max_length(), embedder.max_length(query=True)
    if fmt == "cram":
        return (
            f"cram embed DIR texts.txt --out vectors.npy            # documents, cut at {documents} tokens\n"
            f"cram embed DIR queries.txt --query --out queries.npy  # queries, cut at {queries} tokens"
        )
    if fmt == "transformers":
        return (
            "from transformers import AutoModel, AutoTokenizer\n\n"
            f'model = AutoModel.from_pretrained("DIR")  # {embedder.pooling} pooling of last_hidden_state, normalised\n'
            'tokenizer = AutoTokenizer.from_pretrained("DIR")'
        )
    return (
        "from sentence_transformers import SentenceTransformer\n\n"
        'model = SentenceTransformer("DIR")\n'
        f'documents = model.encode(["a text"])  # unit vectors, cut at {documents} tokens: dot product = cosine\n'
        f"model.max_seq_length = {queries}  # queries: cut where fine-tuning cut them\n"
        'queries = model.encode(["a question"])'
    )


def _usage(fmt: str, task: str | None) -> str:
    if task is not None and fmt == "cram":
        return "cram predict DIR texts.csv --out labels.jsonl"
    if task is not None:
        return (
            "from transformers import pipeline\n\n"
            'classify = pipeline("text-classification", model="DIR")\n'
            'classify(["a text"])\nclassify({"text": "a text", "text_pair": "its pair"})'
        )
    if fmt == "cram":
        return (
            "from pathlib import Path\n\nfrom cram import model\n"
            "from cram.stages.kept import load_export\n\n"
            'cfg, params, tokenizer = load_export(Path("DIR"))\nhidden = model.encode(params, cfg, input_ids, mask)'
        )
    return (
        "from transformers import AutoModelForMaskedLM, AutoTokenizer\n\n"
        'model = AutoModelForMaskedLM.from_pretrained("DIR")\ntokenizer = AutoTokenizer.from_pretrained("DIR")'
    )
