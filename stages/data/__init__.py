"""The data stages' helpers: corpus sources and their units (`source`, `corpus`), one reader per
format (`readers`), the hub source (`hub`) and `datasets` folders written and read a batch at a time
(`shards`)."""
