"""Evaluate's compile canary checks every graph the stage runs, once: the fine-tune step and prediction
at each head shape and bucket its tasks' rows fall in, and the held-out masked LM at each length. A
fault in one graph that is not the first (a backend wrong at one length only) is caught, and `auto`
falls back, the reason naming the graph."""

import json

import numpy as np
import pytest
import torch
from test_evaluate import run_stage, upstream  # noqa: F401 (a fixture)

from cram import model
from cram.model import classifier
from cram.stages.evaluate import Config, TaskConfig
from cram.stages.shared import device as devices

pytestmark = pytest.mark.usefixtures("one_thread")

WRONG_AT = 32  # the second bucket (and the second masked-LM length): never the first batch's


def wrong_at_length(real, fault: str):
    """A step factory like `real` whose compiled bf16 graphs go wrong on batches of WRONG_AT tokens alone:
    `fault` "nan" makes their outputs NaN, "raise" raises, as a failed compile does, "none" leaves them
    right. Every step it returns runs eagerly, so nothing compiles."""

    def make(*args, **kw):
        *args, how = args
        step = real(*args, how.eager(), **kw)
        if not (how.compile and how.autocast == torch.bfloat16):
            return step

        def wrong(*inputs, **options):  # options: the fine-tune step's `donate`
            batch = next(x for x in inputs if isinstance(x, dict) and "input_ids" in x)
            out = step(*inputs, **options)
            if fault == "none" or batch["input_ids"].shape[1] != WRONG_AT:
                return out
            if fault == "raise":
                raise RuntimeError("injected C++ compile error")
            return torch.utils._pytree.tree_map(lambda t: t * float("nan") if t.is_floating_point() else t, out)

        return wrong

    return make


def task_files(folder):
    """A two-label task whose first training batch is short (bucket 16) and whose later training and
    test rows are long (bucket 32)."""
    folder.mkdir()
    for split, n, short, long in (("train", 16, 2, 24), ("test", 8, 3, 26)):
        words = [short if i < n // 2 else long for i in range(n)]
        records = [{"text": " ".join(["aim"] * w), "label": f"l{i % 2}"} for i, w in enumerate(words)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return TaskConfig(
        kind="custom", name="long", path=str(folder), text_fields=("text",), metrics=("accuracy",), epochs=1, seeds=1
    )


def auto(**kw) -> Config:
    return Config(
        **{"batch_size": 8, "eval_batch_size": 8, "max_length": 32, "buckets": (16, WRONG_AT), "backend": "inductor"},
        precision="auto",
        **kw,
    )


@pytest.mark.parametrize(
    "graph, fault, named",
    [
        ("make_finetune_step", "nan", f"fine-tune step, 2 outputs, length {WRONG_AT}"),
        ("make_classify_eval_step", "nan", f"prediction, 2 outputs, length {WRONG_AT}"),
        ("make_finetune_step", "raise", f"fine-tune step, 2 outputs, length {WRONG_AT}: RuntimeError: injected"),
    ],
)
def test_a_fault_in_a_later_bucket_falls_back_and_names_the_graph(
    upstream,  # noqa: F811
    tmp_path,
    make_ctx,
    monkeypatch,
    graph,
    fault,
    named,
):
    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: True)
    for name in ("make_finetune_step", "make_classify_eval_step"):
        real = getattr(classifier, name)
        monkeypatch.setattr(
            classifier, name, wrong_at_length(real, fault) if name == graph else wrong_at_length(real, "none")
        )
    config = auto(tasks=[task_files(tmp_path / "task")], mlm=False)
    out, results = run_stage(config, upstream["inputs"], tmp_path, make_ctx)
    assert out["precision"] == "fp32" and named in out["precision_reason"], out["precision_reason"]
    assert np.isfinite(results["tasks"]["long"]["train_loss"][0])


def test_a_fault_in_a_later_masked_lm_length_falls_back_and_names_it(upstream, tmp_path, make_ctx, monkeypatch):  # noqa: F811
    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: True)
    monkeypatch.setattr(model, "make_eval_step", wrong_at_length(model.make_eval_step, "nan"))
    config = auto(tasks=[], mlm_lengths=(16, WRONG_AT), mlm_batch_size=8)
    out, results = run_stage(config, upstream["inputs"], tmp_path, make_ctx)
    assert out["precision"] == "fp32", out["precision_reason"]
    assert f"held-out masked LM, length {WRONG_AT}" in out["precision_reason"]
    assert all(np.isfinite(r["loss"]) for r in results["mlm"]["by_length"].values())


def test_without_a_fault_every_graph_is_checked_once_and_bf16_kept(upstream, tmp_path, make_ctx, monkeypatch):  # noqa: F811
    from structlog.testing import capture_logs

    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: True)
    for name in ("make_finetune_step", "make_classify_eval_step"):
        monkeypatch.setattr(classifier, name, wrong_at_length(getattr(classifier, name), "none"))
    monkeypatch.setattr(model, "make_eval_step", wrong_at_length(model.make_eval_step, "none"))
    config = auto(tasks=[task_files(tmp_path / "task")], mlm_lengths=(16, WRONG_AT), mlm_batch_size=8)
    with capture_logs() as logs:
        out, _ = run_stage(config, upstream["inputs"], tmp_path, make_ctx)
    assert out["precision"] == "bf16"
    canaries = [e for e in logs if e["event"] == "canary"]
    # a step and a prediction at each of the 2 buckets, the masked LM at each of its 2 lengths
    assert len(canaries) == 1 and canaries[0]["graphs"] == 2 * 2 + 2
