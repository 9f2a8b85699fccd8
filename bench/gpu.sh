#!/usr/bin/env bash
# The CUDA checks in one run, about 8 minutes at most on one GPU (10 when the fallback decode runs): the
# CUDA- and GDS-marked tests, then the GPU rows of the benches (dense decode at 4K and 16K with the model,
# TieredCache and the native loop on the device, the tier bandwidths). Figures go to bench/out/gpu-*.json;
# the summary lines print at the end.
#
#     bash bench/gpu.sh                 # PY=path/to/python to use another interpreter
#     bash bench/gpu.sh tests tiers     # only these steps: tests, tiers, decode (default: all three)
set -uo pipefail
steps=" ${*:-tests tiers decode} "
for s in $steps; do
    case $s in
        tests|tiers|decode) ;;
        *) echo "gpu.sh: unknown step '$s'; the steps are tests, tiers, decode" >&2; exit 2;;
    esac
done
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-bench/out}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.

"$PY" - <<'PY' || { echo "gpu.sh: no CUDA device visible to torch; nothing to run" >&2; exit 2; }
import sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
PY
mkdir -p "$OUT"    # (once there is something to write into it)

status=0
step() {   # step NAME SECONDS COMMAND...: run with a time limit, note a failure, go on
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" && return
    echo "== $name: FAILED or timed out ($?)"
    status=1
    return 1
}
wants() { [[ $steps == *" $1 "* ]]; }
# only the files with marked tests: collecting the whole suite would import every optional extra
marked=$(grep -rlE "mark\.(cuda|gds)" tests)
wants tests && step "cuda and gds tests" 150 "$PY" -m pytest -q -m "cuda or gds" \
    ${marked:?no test file is marked cuda or gds}
wants tiers && step "tiers" 120 "$PY" bench/tiers.py --quick --out "$OUT/gpu-tiers.json"
# the model, its caches and the gpu tier on the device, bf16 (what --dtype auto picks on CUDA)
dense=(bench/decode.py --device cuda --dtype bfloat16 --contexts 4K,16K --steps 16 --reuse-at none
       --sparse-contexts none --branch-contexts none)
if wants decode && ! step "decode 4K,16K" 200 "$PY" "${dense[@]}" --out "$OUT/gpu-decode.json"; then
    step "decode 4K,16K, transformers and TieredCache rows only" 150 "$PY" "${dense[@]}" \
        --dense-rows static-cache,tiered-cache,tiered-cache-small,dynamic-cache-folded --out "$OUT/gpu-decode-hf.json"
fi
exit $status
