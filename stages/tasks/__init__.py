"""The bottom of the evaluate side: what every task kind reads and is (`config`: a task entry's shared fields
and the fine-tune settings; `kind`: the Kind protocol a kind's wing implements)."""
