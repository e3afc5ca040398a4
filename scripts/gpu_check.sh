#!/usr/bin/env bash
# One-command GPU check of issue 34 on one H200, at most 8 minutes (budget 450 s + setup):
#   1. kernel tests on CUDA, 2. kernel table vs cuBLAS bf16 / torch int4pack / _int_mm on decode
#   shapes (CUDA graphs, median and spread) -> kernel_table.json, 3. runtime decode bf16 vs W4 vs
#   W8A8 (SmolLM2-135M and 1.1B shapes, random weights; eager and from CUDA graphs),
#   4. GPTQ / AWQ / AutoRound of the 1.1B shape with `device: cuda`, 5. perplexity GPU vs CPU
#   (and GPU layer by layer).
# Writes gpu_check.json, gpu_check.md, kernel_table.json, kernel_tests.log into $OUT (or --out
# DIR; default ./out). A failing section records its error; the others still run.
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run] [--sections 12345] [--budget-s 450]
# --dry-run: the same Python on the CPU, tiny shapes, kernels interpreted (plumbing only).
# On the device machine (no registry): wheels in .whl/ (pydantic's; docs/notes/gpu-check.md) are
# installed first, then this checkout without dependencies; carry .whl and
# .gpu/data/wikitext-2-raw (.gpu/data: a link to the data folder). Sections 4-5 read their
# calibration and evaluation text from .gpu/data.
# To commit the measured table: cp $OUT/kernel_table.json compress/kernels/configs/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
mkdir -p "$OUT"
DRY=0
for a in "${ARGS[@]+"${ARGS[@]}"}"; do [ "$a" = "--dry-run" ] && DRY=1; done
[ "$DRY" -eq 1 ] || unset TRITON_INTERPRET
if [ -d .whl ] && [ "$DRY" -eq 0 ]; then
    SITE="${WHEEL_SITE:-$(mktemp -d)}"  # where the carried wheels are unpacked
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# The check runs outside the checkout: from its root `python3 -c` imports compress from the
# working directory even when it is not installed, and `python3 scripts/...` then would not.
(cd / && python3 -c "import compress.kernels") 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
# Without setuptools there the install fails; the checkout on the path serves every section.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .gpu/data ] && export COMPRESS_DATA_DIR="$PWD/.gpu/data"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}" PYTHONUNBUFFERED=1
timeout 480 python3 scripts/gpu_check.py --out "$OUT" "${ARGS[@]+"${ARGS[@]}"}" 2>&1 \
    | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || echo "gpu_check.py exited with $status (124: the 480 s timeout); partial results kept in $OUT"
exit "$status"
