#!/usr/bin/env bash
# Set up, lint (ruff), type-check (mypy, as configured in pyproject.toml), then run the whole test suite
# (fast and slow tests). A lint or type error fails the script before pytest runs. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/mypy
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
