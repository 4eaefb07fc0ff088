"""Retrieval's parts, not yet wired into a stage: a BEIR folder and training pairs read and checked
(`beir`), the field's scores as trec_eval computes them (`metrics`), the BM25 baseline (`bm25`), exact
top-k search over embeddings on disk (`search`) and the contrastive loss with its batches (`loss`)."""
