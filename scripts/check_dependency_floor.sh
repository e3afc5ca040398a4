#!/usr/bin/env bash
# Do our exports load right on the lowest transformers and compressed-tensors that pyproject.toml
# declares? The main environment exports tiny quantized Llamas (scripts/dependency_floor.py) with
# the greedy tokens and logits it computes; a second venv holding exactly those floors loads
# them with plain AutoTokenizer + AutoModelForCausalLM and must reproduce both.
#
# The venv reuses this interpreter's packages (--system-site-packages: torch is not downloaded
# again; torch is pinned to the installed version so pip never replaces it) and is cached under
# .cache/dependency-floor/ (git-ignored), keyed by the floors, Python and torch: the first run
# downloads transformers/tokenizers/huggingface_hub/compressed-tensors (~30 s), reruns do not.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false

read -r TF CT < <("$PY" scripts/dependency_floor.py floors)
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
PYV=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
CACHE="$PWD/.cache/dependency-floor"
VENV="$CACHE/venv-py$PYV-torch$TORCH-transformers$TF-ct$CT"
if [[ ! -f "$VENV/.complete" ]]; then
    echo "creating $VENV"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$PY" -m venv --system-site-packages "$VENV"
    echo "torch==$TORCH" > "$VENV/constraints.txt"
    # transformers' and compressed-tensors' own pins pick tokenizers and huggingface_hub
    # (transformers 4.x needs huggingface_hub<1 and an older tokenizers than the main env).
    # pip's log only on failure: it also warns that the main env's packages (e.g. datasets)
    # want a newer huggingface_hub, which is true there and irrelevant in this venv.
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        -c "$VENV/constraints.txt" "transformers==$TF" "compressed-tensors==$CT" \
        > "$VENV/pip.log" 2>&1; then
        cat "$VENV/pip.log"
        exit 1
    fi
    touch "$VENV/.complete"
fi

OUT=$(mktemp -d "${TMPDIR:-/tmp}/dependency-floor.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
"$PY" scripts/dependency_floor.py export "$OUT"
"$VENV/bin/python" scripts/dependency_floor.py check "$OUT"  # plain transformers, no compress
echo "dependency floor OK: transformers $TF, compressed-tensors $CT, torch $TORCH"
