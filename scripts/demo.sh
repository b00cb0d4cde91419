#!/usr/bin/env bash
# Set up, then run the main job on the embedded default model (SmolLM2-135M-Instruct, offline, CPU):
# build a verbosity variant with automatic strength, and canary it against its base.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
OUT="${1:-out/smollm2-concise}"
.venv/bin/blaze edit --base smollm2 --behavior verbosity --out "$OUT" --force
.venv/bin/blaze canary "$OUT" --against smollm2 --json "$OUT.canary.json" --markdown "$OUT.canary.md"
