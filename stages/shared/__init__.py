"""What more than one stage uses: special token ids, the masking rule, the held-out MLM loss, the
tensor file format, collectives across torchrun ranks, device and precision, experiment loggers and
the progress bar; and what the pipeline shares with the stages: atomic writes, file fingerprints and
what counts as a figure. Nothing here imports the pipeline."""
