"""The evaluate stage's helpers: its config and the small values made of it (`config`), tasks as
text/label examples (`tasks`: GLUE, custom files, held-out topics), their scores (`metrics`), the
per-seed fine-tuning loop (`finetune`), the checks before it (`checks`) and the held-out masked LM
(`heldout`)."""
