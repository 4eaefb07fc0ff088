"""cram's fine-tune step computes what transformers' fine-tuning does: from one BertForSequenceClassification
checkpoint, with the same head and batches and dropout off, cram's step (functional AdamW, the
pooler-started head) and `torch.optim.AdamW` over the transformers model give the same loss step by step."""

import pytest
import torch

from cram import model
from cram.model.classifier import init_head_params, make_finetune_step, pooler_head
from cram.stages.shared.pretrained import load, locate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fine_tune_steps_match_transformers_bert_classifier(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    theirs = transformers.BertForSequenceClassification(config)
    theirs.save_pretrained(tmp_path / "ckpt")
    cfg, params = load(locate(tmp_path / "ckpt"))
    head = pooler_head(init_head_params(cfg, 3, seed=0, width=cfg.hidden), params)
    head["classifier.out.weight"] = theirs.classifier.weight.detach().clone()
    head["classifier.out.bias"] = theirs.classifier.bias.detach().clone()
    ours, state = {**params, **head}, None
    state = model.optimizer_init(model.AdamW(), ours)
    opt_cfg = model.AdamW(lr=1e-2, eps=1e-6, weight_decay=0.0, clip_norm=0.0)
    step = make_finetune_step(cfg, opt_cfg, model.EAGER, pooling="pooler")
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0)
    theirs.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 96, (8, 16), generator=gen)
    mask = torch.ones(8, 16, dtype=torch.bool)
    mask[:4, 10:] = False  # padded rows: their keys are never read
    labels = torch.randint(0, 3, (8,), generator=gen)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "weights": torch.ones(8)}
    losses = []
    for _ in range(6):  # one batch again and again: the loss must fall, so the steps really move
        ours, state, metrics = step(ours, state, {**batch, "dropout": torch.tensor(0.0)}, torch.tensor(1e-2))
        out = theirs(input_ids=ids, attention_mask=mask.long(), token_type_ids=torch.zeros_like(ids), labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((float(metrics["loss"]), float(out.loss)))
    assert losses[-1][0] < 0.5 * losses[0][0]
    for mine, reference in losses:
        assert mine == pytest.approx(reference, rel=1e-4, abs=1e-5)
