#!/usr/bin/env bash
# The README's test command: install what is missing (idempotent), then the static checks
# (seconds, so a lint or layering slip fails before the minutes of tests), then the whole suite.
# Extra arguments go to pytest (e.g. `make test ARGS="-k spec"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh all
bash scripts/check.sh
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
