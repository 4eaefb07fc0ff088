"""`cram status`'s figures column shows evaluate's task scores after its masked-LM figures at several lengths,
and leaves the per-task times (the row has the stage's duration) out."""

from cram.pipeline.commands.cli_output import _figures


def test_task_scores_follow_the_masked_lm_figures_at_two_lengths():
    outputs = {
        "results": "results.json",
        "mlm_loss": 3.73,
        "mlm_accuracy": 0.36,
        "mlm_loss@128": 3.73,
        "mlm_accuracy@128": 0.36,
        "mlm_loss@512": 3.72,
        "mlm_accuracy@512": 0.36,
        "topic_accuracy": 0.83,
        "topic_macro_f1": 0.77,
        "topic_baseline": 0.2,
        "topic_time_s": 13.1,
        "retrieval_ndcg@10": 0.44,
        "retrieval_recall@100": 0.9,
        "retrieval_mrr@10": 0.39,
        "retrieval_baseline": 0.96,
        "retrieval_time_s": 12.7,
        "precision": "bf16",
    }
    shown = _figures(outputs)
    for figure in ("mlm_loss@512=3.72", "topic_accuracy=0.83", "topic_baseline=0.2", "retrieval_ndcg@10=0.44"):
        assert figure in shown
    assert "time_s" not in shown and "precision" not in shown
