#!/usr/bin/env bash
# The CuPy backend's checks on an NVIDIA GPU, in one run of under 8 minutes, fetching nothing:
#   1. ops     accel/harness.py's op cases (test-backend-ops style) against reference/ops.py
#   2. parity  whole-model logits on every tiny model against the numpy reference (gate NMSE 1e-8)
#   3. graph   decode steps replayed from the captured CUDA graph against eager launches, bit for bit
#   4. mid     a 2-layer model of the release widths (UD-IQ2_XXS mix, tools/regen/make_synthetic.py): its
#              products against ops.linear (first 512 rows of each matrix; a whole numpy forward at
#              these widths takes minutes), then the prefill/decode benchmark with the decode
#              bandwidth against 4.8 TB/s and its projection to 52 layers
#   5. pytest  the GPU tests of tests/test_cuda.py
#   6. 30b     only if the budget still holds it: the 52-layer release layout (UD-IQ2_XXS mix, 9.2 GB),
#              written there, then the same benchmark at the full depth (no projection needed)
#
#   bash tools/bench/gpu_check.sh [OUT_DIR]          (default build/gpu_check; logs and JSON land there)
#
# Python is $PYTHON, else python3. A package it lacks (gguf on a bare CUDA image) is installed only
# from the wheels in $WHEELS (default .whl), with pip --no-index into OUT_DIR/site; nothing is
# downloaded. Fill that folder beforehand, where an index is reachable:
#   pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# Each step has its own time limit; steps that would start past the budget are skipped and said so.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root: the script lives in tools/bench
OUT=${1:-build/gpu_check}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-470}  # seconds: the steps' total, under 8 minutes
MID=build/mid-ud-iq2_xxs.gguf
BIG=build/30b-ud-iq2_xxs.gguf
mkdir -p "$OUT" build
export PYTHONUNBUFFERED=1
status=0
start=$SECONDS

missing=$("$PY" -c '
import importlib.util
print(" ".join(m for m in ("numpy", "scipy", "gguf", "cupy", "tqdm", "yaml", "pytest")
               if importlib.util.find_spec(m) is None))')
if [ -n "$missing" ]; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: missing Python packages: $missing (no wheels in $WHEELS to install them from)" >&2
        exit 2
    fi
    echo "== installing $missing from $WHEELS (no index)"
    "$PY" -m pip install -q --no-index --no-deps --target "$OUT/site" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$PWD/$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__)' | tee -a "$OUT/gpu.txt"

fits() {  # fits LIMIT_S: whether a step of that limit still ends within the budget
    (( SECONDS - start + $1 <= BUDGET ))
}

step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    if ! fits "$limit"; then
        echo "== $name: SKIPPED, $((SECONDS - start)) s spent of a $BUDGET s budget"
        status=1
        return
    fi
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    (( rc == 0 )) || status=1
}

step ops 90 "$PY" -m accel.harness --backend cupy
step parity 90 "$PY" -m accel.cuda_harness parity --json "$OUT/parity.json"
step graph 45 "$PY" -m accel.cuda_harness graph --json "$OUT/graph.json"
[ -f "$MID" ] || step make_mid 90 "$PY" -m tools.make_synthetic "$MID" --layout 30b --mix ud-iq2_xxs --layers 2
if [ -f "$MID" ]; then
    step mid_products 60 "$PY" -m accel.cuda_harness products "$MID" --json "$OUT/mid_products.json"
    step bench 75 "$PY" -m accel.cuda_harness bench "$MID" --prompt-len 512 --n-decode 32 --json "$OUT/bench.json"
fi
step pytest 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k gpu
# The release depth is optional: writing 9.2 GB and uploading it is worth it only with time to spare.
if [ -f "$BIG" ] || fits 240; then
    [ -f "$BIG" ] || step make_30b 120 "$PY" -m tools.make_synthetic "$BIG" --layout 30b --mix ud-iq2_xxs
    [ -f "$BIG" ] && step bench_30b 120 "$PY" -m accel.cuda_harness bench "$BIG" --prompt-len 512 --n-decode 32 \
        --json "$OUT/bench_30b.json"
else
    echo "== 30b: not run, $((SECONDS - start)) s spent of a $BUDGET s budget (optional)"
fi
echo "gpu_check: $((SECONDS - start)) s, $([ $status -eq 0 ] && echo 'all steps passed' || echo 'FAILED or skipped steps above')"
exit $status
