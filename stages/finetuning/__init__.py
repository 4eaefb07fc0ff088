"""The evaluate stage's fine-tuning: tasks as text/label examples (`tasks`: GLUE, custom files,
held-out topics), their scores (`metrics`) and the per-seed fine-tuning loop (`finetune`)."""
