#!/usr/bin/env bash
# The step benchmark on one GPU: base config in bf16, cram compiled and eager against transformers'
# BertForMaskedLM eager and compiled; prints the table of bench/step.py (about 5-8 minutes, mostly
# compiling). Made for a machine with torch + CUDA and no network.
#
#   bench/gpu.sh                                  # base, cuda, bf16
#   bench/gpu.sh --device cpu --config tiny       # the CPU path (tests run it so)
#
# Extra flags go to bench/step.py and override the defaults above. transformers is a bench-only extra:
# if it is not importable, it is installed from wheels in $CRAM_WHEELS (default bench/wheels) when that
# folder exists, never from the network; without it the BERT rows say "transformers not installed".
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
wheels="${CRAM_WHEELS:-$root/bench/wheels}"

if ! "$python" -c "import transformers" 2>/dev/null && [ -d "$wheels" ]; then
    "$python" -m pip install --quiet --no-index --find-links "$wheels" transformers \
        || echo "transformers: installing from $wheels failed; the BERT rows will be skipped" >&2
fi

cd "$root"
# Without an install (a bare GPU machine, no network to build one), `cram` is the repository's three
# source folders linked into a temporary namespace package.
if ! "$python" -c "import cram.model" 2>/dev/null; then
    shim="$(mktemp -d)"
    mkdir "$shim/cram"
    for folder in model pipeline stages; do ln -s "$root/$folder" "$shim/cram/$folder"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" bench/step.py --config base --device cuda "$@"
