"""transformers' masked LMs as rows of `bench/gpu_profile.py`: ModernBERT (sparse prediction, the fair peer of
cram's step) and BERT (bench/step.py's row), each compiled, at the base shape and batch."""

from __future__ import annotations

import argparse

from gpu_measure import MASK_RATE, SHAPES, autocast, base_config, make_batch, sheet_peak, timing


def modernbert_child(args: argparse.Namespace, row: str) -> dict:
    """transformers' ModernBertForMaskedLM at the base shape: sparse prediction, SDPA, compiled."""
    import torch

    try:
        from transformers import ModernBertConfig, ModernBertForMaskedLM
    except ImportError:
        return {"row": row, "skipped": "transformers (with ModernBERT) is not installed"}
    cfg, batch, device = base_config(args), SHAPES[args.shapes].batch, torch.device(args.device)
    hf_cfg = ModernBertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        intermediate_size=cfg.ffn_inner,  # ModernBERT's Wi has twice this many outputs: cram's `intermediate`
        max_position_embeddings=cfg.max_seq_len,
        layer_types=["full_attention"] * cfg.layers,  # every layer global, as cram's base
        global_attn_every_n_layers=1,  # the same in the spelling of transformers before layer_types
        sparse_prediction=True,
        attn_implementation="sdpa",
        **dict(pad_token_id=0, cls_token_id=1, bos_token_id=1, sep_token_id=2, eos_token_id=2),
    )
    net = ModernBertForMaskedLM(hf_cfg).to(device).train()
    step = hf_step(net, autocast(args), args.backend, device)
    batches = [make_batch(cfg, batch, device, seed) for seed in range(4)]
    result = {"row": row, "batch": batch, **timing(step, batches, device, args.steps)}
    encoder = sum(p.numel() for n, p in net.named_parameters() if ".layers." in n or "final_norm" in n)
    head = sum(p.numel() for p in net.head.parameters())
    flops = 6 * encoder + 12 * cfg.layers * cfg.hidden * cfg.max_seq_len
    flops += 6 * (head + cfg.hidden * cfg.vocab_size) * MASK_RATE
    return result | hf_figures(result, flops, batch * cfg.max_seq_len, device)


def bert_child(args: argparse.Namespace, row: str) -> dict:
    """transformers' BertForMaskedLM (bench/step.py's row: dense prediction, SDPA, compiled)."""
    import step as step_bench  # bench/step.py
    import torch

    cfg, batch, device = base_config(args), SHAPES[args.shapes].batch, torch.device(args.device)
    try:
        make_step, flops = step_bench.bert_row(cfg, device, autocast(args), args.backend, compiled=True)
    except ImportError:
        return {"row": row, "skipped": "transformers is not installed"}
    batches = [make_batch(cfg, batch, device, seed) for seed in range(4)]
    result = {"row": row, "batch": batch, **timing(make_step(), batches, device, args.steps)}
    return result | hf_figures(result, flops, batch * cfg.max_seq_len, device)


def hf_step(net, dtype, backend: str, device):
    """step(batch) -> loss of a transformers masked LM: compiled forward, backward, clipping at 0.5, AdamW."""
    import contextlib

    import torch

    decay = [p for p in net.parameters() if p.ndim >= 2]
    rest = [p for p in net.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.98), eps=1e-12, foreach=True)
    forward = torch.compile(net, backend=backend)

    def step(batch):
        context = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with context:
            loss = forward(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def hf_figures(result: dict, flops_per_token: float, tokens: int, device) -> dict:
    step_s = result["step_ms_back_to_back"] / 1e3
    peak = sheet_peak(device)
    mfu = None if peak is None else flops_per_token * tokens / step_s / peak
    return {"tokens_per_s": tokens / step_s, "mfu": mfu, "hfu": mfu}
