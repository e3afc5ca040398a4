#!/usr/bin/env bash
# One-command GPU check of the Triton kernels (one H200: about 7 minutes measured on 2026-11-30):
#   1. kernel tests on CUDA (interpreter off), 2. kernel benchmark, 3. SmolLM2 decode tokens/s.
# Results go to $OUT (default ./out). Every step has its own timeout and the benchmark saves its
# JSON after each shape.
# On a machine without registries: wheels in .whl/ (pydantic's, see docs/notes/gpu-check.md) are
# installed first, then this checkout without dependencies. SMOLLM2_CONFIG=path/config.json makes
# step 3 build the model from that config with random weights (no checkpoint on the machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
if [ -d .whl ]; then
    SITE="${WHEEL_SITE:-$(mktemp -d)}"  # where the carried wheels are unpacked
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl && export PYTHONPATH="$SITE"
fi
python3 -c "import compress.kernels" 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

status=0
# the CPU-only kernel tests (alignment, AVX2 extension) are CI's; here only what runs on CUDA
timeout 240 python3 -m pytest tests/kernels -m "not slow" -q -p no:cacheprovider \
    --ignore tests/kernels/test_alignment.py --ignore tests/kernels/test_cpu_q8.py \
    2>&1 | tee "$OUT/kernel_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "kernel tests FAILED or timed out"; status=1; }

timeout 200 python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark FAILED or timed out (partial JSON kept)"; status=1; }

# End-to-end decode needs compress.io.load and the SmolLM2 weights: optional, reported if absent.
if python3 -c "from compress.io.load import load_model" 2>/dev/null; then
    timeout 120 python3 scripts/bench_kernels.py --out "$OUT/e2e" --shapes --e2e \
        ${SMOLLM2_CONFIG:+--config "$SMOLLM2_CONFIG"} 2>&1 \
        | tee "$OUT/e2e.log" || echo "e2e decode FAILED or timed out"
else
    echo "e2e decode skipped: compress.io.load.load_model is not available" | tee "$OUT/e2e.log"
fi
exit $status
