"""The README.md of an export: how to load it, the run's figures per stage and its resolved config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cram.stages.shared.figures import is_number


@dataclass(frozen=True)
class Card:
    """What a model card says of the run an export comes from."""

    run: str  # the run's name
    figures: dict[str, dict[str, Any]]  # stage -> its outputs (the numbers are quoted)
    config: str  # the run's resolved config, TOML


def model_card(card: Card, fmt: str, task: str | None = None) -> str:
    """README.md of an export of `card`'s run in format `fmt` (with `task`, its kept classifier)."""
    lines = [
        f"# {card.run}",
        "",
        f"A BERT-style masked language model crammed by `cram` (run `{card.run}`), exported in the `{fmt}` format."
        if task is None
        else f"The `{task}` classifier fine-tuned by `cram` (run `{card.run}`), exported in the `{fmt}` format.",
        "",
        "```python",
        _usage(fmt, task),
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
