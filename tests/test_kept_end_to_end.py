"""The real pipeline (a few-KB corpus, a tiny eager model) keeps its fine-tuned classifier: shown by
`cram inspect`, kept through a cached re-run, exported (refused where the head has no transformers
form, naming the setting), and used by `cram predict` with the labels transformers gives."""

from __future__ import annotations

import json

import pytest
import torch
from test_bad_inputs import cram, write_workspace

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def test_the_kept_classifier_is_shown_survives_a_cached_run_and_predicts(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    assert cram("run", "pipeline.toml").exit_code == 0
    run = tmp_path / "runs" / "base"
    inspect = cram("inspect", "runs/base", "evaluate", "--lines", "0")
    assert '"classifiers"' in inspect.output and '"sent": "classifiers/0-sent/seed-0"' in inspect.output, inspect.output
    kept = run / "evaluate" / "classifiers" / "0-sent" / "seed-0"
    before = {p.name: p.read_bytes() for p in kept.iterdir()}

    again = cram("run", "pipeline.toml")  # everything cached: the classifier is the store's, unchanged
    assert again.exit_code == 0 and {p.name: p.read_bytes() for p in kept.iterdir()} == before
    assert cram("verify", "runs/base").exit_code == 0

    texts = tmp_path / "texts.csv"
    texts.write_text("text,label\n" + "".join(f"the {w} sat on the mat,0\n" for w in ("cat", "dog", "sun", "rug")))
    shown = cram("predict", "runs/base", str(texts), "--task", "sent", "--no-compile")
    rows = [json.loads(line) for line in shown.output.splitlines()]
    assert shown.exit_code == 0 and len(rows) == 4 and all(set(r["probabilities"]) == {"0", "1"} for r in rows)

    # The default head is cramming's (1024 wide, tanh): ModernBERT's classifier cannot hold it.
    refused = cram("export", "runs/base", "--task", "sent", "--to", "hf", "--format", "transformers")
    assert refused.exit_code == 2 and 'set evaluate.head="modernbert"' in refused.output, refused.output

    # head = "auto" re-runs evaluate alone (its key changes), with ModernBERT's head: it exports exactly.
    assert cram("run", "pipeline.toml", "--set", "evaluate.head=auto").exit_code == 0
    assert cram("export", "runs/base", "--task", "sent", "--to", "hf", "--format", "transformers").exit_code == 0
    assert cram("export", "runs/base", "--task", "sent", "--to", "mine").exit_code == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sentences = [line.split(",")[0] for line in texts.read_text().splitlines()[1:]]
    with torch.no_grad():
        expected = hf(**tokenizer(sentences, padding=True, return_tensors="pt")).logits.argmax(-1)
    out = tmp_path / "labels.csv"
    assert cram("predict", "mine", str(texts), "--out", str(out), "--no-compile").exit_code == 0
    labels = [line.split(",")[0] for line in out.read_text().splitlines()[1:]]
    assert labels == [hf.config.id2label[int(i)] for i in expected]
