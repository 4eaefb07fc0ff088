"""Token classification in the evaluate stage (`kind = "token-classification"`): a CoNLL, JSON-lines or
`datasets` folder read into words and IOB2 tags (`reading`), words cut into sub-tokens and long sentences into
overlapping windows (`windows`), the fine-tune per seed, its steps' sentences packed into few rows (`tuning`,
`packing`), entity F1 as conlleval scores it beside
the all-O and dictionary baselines (`scores`), the results and the kept tagger (`results`, `kind`), and a kept
tagger run on texts by `cram predict` (`predicting`)."""
