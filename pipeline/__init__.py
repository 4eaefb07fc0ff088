"""The cram pipeline: config, run directories, the runner and the `cram` CLI."""
