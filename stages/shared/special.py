"""The ids of the special tokens in every tokenizer cram trains; tokenize writes them into its outputs,
and every later stage reads them from there (pack's `special_ids`)."""

SPECIAL_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
