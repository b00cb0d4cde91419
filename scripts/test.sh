#!/usr/bin/env bash
# Set up, lint (ruff), type-check (mypy, as configured in pyproject.toml), then run the whole test suite
# (fast and slow tests). A lint or type error fails the script before pytest runs. Extra arguments go to pytest.
# Two pytest-xdist workers, one torch thread each (tests/conftest.py): the suite's longest test (SmolLM2's
# statistics and held-out canary, ~6 min) runs beside all the others. BLAZE_TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/mypy
set +e
workers="${BLAZE_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  .venv/bin/python -m pytest -q --durations=10 "$@"
else
  .venv/bin/python -m pytest -q -n "$workers" --durations=10 "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
