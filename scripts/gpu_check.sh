#!/usr/bin/env bash
# One-command GPU check of the Triton kernels (one H200, meant to finish in < 8 minutes):
#   1. kernel tests on CUDA (interpreter off), 2. kernel benchmark, 3. SmolLM2 decode tokens/s.
# Results go to $OUT (default ./out). Not yet run on a GPU: the time budget is an estimate,
# so every step has its own timeout and the benchmark saves its JSON after each shape.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

status=0
timeout 150 python -m pytest tests/kernels -m "not slow" -q -x -p no:cacheprovider \
    --junitxml "$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "kernel tests FAILED or timed out"; status=1; }

timeout 270 python scripts/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark FAILED or timed out (partial JSON kept)"; status=1; }

# End-to-end decode needs compress.models and the SmolLM2 weights: optional, reported if absent.
if python -c "from compress.models import load_model" 2>/dev/null; then
    timeout 60 python scripts/bench_kernels.py --out "$OUT/e2e" --shapes --e2e 2>&1 \
        | tee "$OUT/e2e.log" || echo "e2e decode FAILED or timed out"
else
    echo "e2e decode skipped: compress.models.load_model is not available" | tee "$OUT/e2e.log"
fi
exit $status
