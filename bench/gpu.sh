#!/usr/bin/env bash
# The CUDA checks in one run, under 8 minutes on one GPU: the CUDA- and GDS-marked tests, then the GPU
# rows of the benches (dense decode at 4K with TieredCache and the native loop on the device, the tier
# bandwidths). Figures go to bench/out/gpu-*.json; the summary lines print at the end.
#
#     bash bench/gpu.sh                 # PY=path/to/python to use another interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.

"$PY" - <<'PY' || { echo "gpu.sh: no CUDA device visible to torch; nothing to run" >&2; exit 2; }
import sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
PY

status=0
step() {   # step NAME SECONDS COMMAND...: run with a time limit, note a failure, go on
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" || { echo "== $name: FAILED or timed out ($?)"; status=1; }
}
step "cuda and gds tests" 150 "$PY" -m pytest -q -m "cuda or gds" tests
step "tiers" 120 "$PY" bench/tiers.py --quick --out "$OUT/gpu-tiers.json"
step "decode 4K" 200 "$PY" bench/decode.py --contexts 4K --steps 8 --reuse-at none --sparse-contexts none \
    --branch-contexts none --out "$OUT/gpu-decode.json"
exit $status
