#!/usr/bin/env bash
# Set up, then run the main job on the embedded default model (SmolLM2-135M-Instruct, offline, CPU):
# build a verbosity variant with automatic strength, and canary it against its base.
# Exit code: 0 when both gates passed, 1 when a gate failed (the reports say which check), 2/3 as blaze's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
# OpenMP threads that wait at a barrier sleep instead of spinning. Same threads, same numbers; on a shared
# 2-core machine the spinning made each generation pass ~10x slower (8 answers: 251 s spinning, 27 s passive,
# load 8). A value set by the caller wins.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
OUT="${1:-out/smollm2-concise}"
set +e
.venv/bin/blaze edit --base smollm2 --behavior verbosity --out "$OUT" --force
edit_rc=$?
set -e
if [ "$edit_rc" -eq 1 ] && [ ! -f "$OUT/blaze_manifest.json" ]; then
  echo "demo: no strength passed the gate on the validation prompts; nothing was written" >&2
  exit 1
elif [ "$edit_rc" -ne 0 ] && [ "$edit_rc" -ne 1 ]; then
  exit "$edit_rc"
fi
set +e
.venv/bin/blaze canary "$OUT" --against smollm2 --json "$OUT.canary.json" --markdown "$OUT.canary.md"
canary_rc=$?
set -e
echo "demo: edit exit $edit_rc, canary exit $canary_rc (0 passed, 1 gate failed); reports in $OUT/ and $OUT.canary.md" >&2
[ "$edit_rc" -eq 0 ] && exit "$canary_rc"
exit "$edit_rc"
