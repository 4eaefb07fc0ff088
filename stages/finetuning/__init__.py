"""The classification kind of evaluate task (`kind = "heldout-topic"`, `"glue"`, `"custom"`): the kind as the
orchestration calls it (`kind`), tasks as text/label examples (`tasks`: GLUE, custom files, held-out topics),
their scores (`metrics`) and the per-seed fine-tuning loop (`finetune`)."""
