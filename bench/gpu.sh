#!/usr/bin/env bash
# The first GPU window in one command (bench/README.md, "The first GPU window"): it reports as it goes and
# ends inside --seconds (default 420: 7 minutes) on an H200 with a cold compile cache. Parts, most telling first:
#   environment  GPU, driver, clocks, torch, CUDA, cuDNN, the commit
#   smoke        bench/step.py: tiny preset, cram compiled and eager, 5 steps (a failure shows in the first minute)
#   pipeline     bench/gpu_smoke.py: pretrain.run on CUDA (document attention, canary, compile, recompile limit),
#                the SDPA kernels with and without the document mask, host syncs over steps 5-30; when it
#                fails, once more with the written-out attention (--attention written)
#   tests        pytest of the tests that need CUDA: non-blocking copies and the prefetch path
#                (tests/test_host_syncs.py), written-out attention against SDPA on CUDA, eager and compiled
#                under torch.func (tests/test_attention.py)
#   big          bench/step.py: base preset, cram compiled, BERT compiled, cram with documents, then the eager
#                rows (a cold base compile takes 70-90 s on an H200: the last rows may be skipped)
#   tiny         bench/step.py: tiny preset, the rows the smoke part left out (not in the default parts)
#   written      bench/step.py: base preset, with documents, written-out attention instead of SDPA (not default)
# Every part and every row runs with its own time limit and keeps its whole stderr in a log; a part that
# fails or hangs shows the last 40 lines of its log, and the next part runs. A part that would start with
# under 30 s left is skipped with a line. Nothing is installed and nothing reaches the network: the
# machine's torch and transformers are used as they are (without transformers the BERT rows say so).
#
#   bench/gpu.sh [--out DIR] [--logs DIR] [--seconds N] [--parts a,b] [--device cuda|cpu] [--big CONFIG]
#                [--backend B] [-- FLAGS FOR EVERY bench/step.py PART]
#   bench/gpu.sh --device cpu --big tiny --backend aot_eager --parts environment,smoke -- --batch 2 --steps 2
#                                                   # its CPU path, as the tests run it
#
# DIR (default bench-out/gpu-<UTC time>) gets report.md, everything printed, and logs.tar.gz, the logs folder
# (default DIR/logs) packed again after every part.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
out="$root/bench-out/gpu-$(date -u +%Y%m%d-%H%M%S)"
logs=""
seconds=420
all_parts="environment,smoke,pipeline,tests,big,tiny,written"
# tiny and written were measured in the first window (bench/RESULTS.md, 2026-12-04) and do not fit beside big
# in one: name them in --parts to run them again.
parts="environment,smoke,pipeline,tests,big"
device=cuda
big=base
backend=inductor
step_flags=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --logs) logs="$2"; shift 2 ;;
        --seconds) seconds="$2"; shift 2 ;;
        --parts) parts="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --big) big="$2"; shift 2 ;;
        --backend) backend="$2"; shift 2 ;;
        --) shift; step_flags=("$@"); break ;;
        *) echo "bench/gpu.sh: unknown option '$1'; the options are listed at the top of bench/gpu.sh" >&2; exit 2 ;;
    esac
done
for name in ${parts//,/ }; do
    case "$name" in
        environment | smoke | pipeline | tests | big | tiny | written) ;;
        *) echo "bench/gpu.sh: --parts: unknown part '$name'; the parts are $all_parts" >&2; exit 2 ;;
    esac
done
logs="${logs:-$out/logs}"
mkdir -p "$out" "$logs" || exit 2
exec > >(tee "$out/report.md") 2>&1
tee_pid=$!
end=$(($(date +%s) + seconds))

cd "$root"
# Without an install (a bare GPU machine, no network to build one), `cram` is the repository's three
# source folders linked into a temporary namespace package.
if ! "$python" -c "import cram.model" 2>/dev/null; then
    shim="$(mktemp -d)"
    mkdir "$shim/cram"
    for folder in model pipeline stages; do ln -s "$root/$folder" "$shim/cram/$folder"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"  # parts share one cache

wanted() { [[ ",$parts," == *",$1,"* ]]; }

# part NAME LIMIT_S COMMAND...: the command under its own limit, never past the overall one.
part() {
    local name="$1" limit="$2"
    shift 2
    wanted "${name%%-*}" || return 0  # pipeline-written goes with pipeline
    local left=$((end - $(date +%s)))
    echo
    echo "## $name ($(date -u +%H:%M:%S) UTC, ${left} s left)"
    if [ "$left" -lt 30 ]; then
        echo "skipped: ${left} s left of the overall ${seconds} s"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout --kill-after=10 "$limit" "$@" 2>"$logs/$name.stderr"
    local code=$?
    if [ "$code" -ne 0 ]; then
        if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
            echo "$name: timed out after ${limit} s (log: $logs/$name.stderr)"
        else
            echo "$name: failed (exit $code; log: $logs/$name.stderr)"
        fi
        echo '```'
        tail -n 40 "$logs/$name.stderr"
        echo '```'
    fi
    tar -czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null
    return "$code"
}

# bench/step.py as a part: its deadline ends before the part's limit, so it stops its own rows first.
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((end - $(date +%s)))
    [ "$limit" -gt "$left" ] && limit=$left
    part "$name" "$limit" "$python" bench/step.py --device "$device" --backend "$backend" --no-in-turn \
        --no-compile-warm --out "$logs/$name" --deadline $((limit - 15)) "$@" "${step_flags[@]+"${step_flags[@]}"}"
}

environment() {
    local commit="${CRAM_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ), host ${HOSTNAME:-unknown}, commit $commit"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm \
        --format=csv,noheader
    "$python" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.get_device_name(0)}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB")
try:
    import transformers
    print(f"transformers {transformers.__version__}")
except ImportError:
    print("transformers not installed: the BERT rows will say so")
EOF
}

echo "# bench/gpu.sh: parts $parts, ${seconds} s in all, device $device, big $big, backend $backend"
export -f environment
export python
part environment 60 bash -c environment
step smoke 150 --config tiny --rows cram-compiled,cram-eager --steps 5 --warmup 1 --row-limit 120
if ! part pipeline 200 "$python" bench/gpu_smoke.py --device "$device" --backend "$backend"; then
    part pipeline-written 150 "$python" bench/gpu_smoke.py --device "$device" --backend "$backend" --attention written
fi
part tests 120 "$python" -m pytest -q -p no:cacheprovider tests/test_host_syncs.py tests/test_attention.py
step big 330 --config "$big" --rows cram-compiled,bert-compiled,cram-doc-compiled,cram-eager,bert-eager --row-limit 200
step tiny 150 --config tiny --rows cram-doc-compiled,cram-written-compiled,bert-compiled,bert-eager --row-limit 90
step written 150 --config "$big" --rows cram-doc-written-compiled --row-limit 140
echo
echo "# bench/gpu.sh: done at $(date -u +%H:%M:%S) UTC; report $out/report.md, logs $out/logs.tar.gz"
exec >&- 2>&-
wait "$tee_pid"
