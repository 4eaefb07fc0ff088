"""Retrieval tasks in the evaluate stage (`kind = "retrieval"`, `"heldout-retrieval"`): a BEIR folder and
training pairs read and checked (`beir`), or made from a corpus and the held-out documents (`pairs`); the
contrastive fine-tune per seed and the search of the corpus's embeddings (`tuning`, its batches `loss`,
the exact top-k `search`); the field's scores as trec_eval computes them (`metrics`) beside the BM25
baseline (`bm25`), written into results.json (`results`)."""
