"""The user's commands (`cram run`, `status`, `inspect`, `compare`, `sweep`, `export`, `predict`) and what
they print; running a plan itself is the package above."""
