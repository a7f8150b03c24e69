#!/usr/bin/env bash
# The README's test command: install what is missing (idempotent), then run the whole suite.
# Extra arguments go to pytest (e.g. `make test ARGS="-k spec"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh all
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
