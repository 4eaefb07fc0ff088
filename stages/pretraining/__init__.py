"""The pretrain stage's helpers: its config (`config`), what it reads and checks (`setup`), continuing a
checkpoint (`continued`, with the head warm-up in `head_warmup`), where training starts (`start`), the
steps (`steps`), the loop and its hooks (`loop`, `hooks`), the budget clock (`budget`), the stream of
training microbatches (`batches`), the phases (`phases`), metrics, progress bar and MFU (`telemetry`),
the training state (`state`) and checkpoints (`checkpoint`)."""
