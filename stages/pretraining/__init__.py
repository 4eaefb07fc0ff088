"""The pretrain stage's helpers: the loop and its hooks (`loop`), the budget clock (`budget`), the
stream of training microbatches (`batches`), metrics, progress bar and MFU (`telemetry`) and
checkpoints (`checkpoint`)."""
