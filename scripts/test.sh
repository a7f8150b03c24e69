#!/usr/bin/env bash
# The README's test command: install what is missing (idempotent), then the static checks
# (seconds, so a lint or layering slip fails before the minutes of tests), then the whole suite.
# Extra arguments go to pytest (e.g. `make test ARGS="-k spec"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh main

# The whole suite needs the tiny model; where it is not cached (a fresh clone) it trains (on one
# thread, as every build does) while the engine venv installs and the checks run, instead of after
# them. The suite adopts the running build (tests/conftest.py: the pid file).
builder=""
if [[ $# -eq 0 ]]; then
  logs=${MODEL_RELEASE_HOME:-.model-release}/logs
  mkdir -p "$logs"
  .venv/bin/python -m pipeline.cli make-tiny-model > "$logs/tiny-model-build.log" 2>&1 &
  builder=$!
  echo "$builder" > "$logs/tiny-model-build.pid"
  echo "test: tiny model: building (or reusing) it in the background (log: $logs/tiny-model-build.log)"
  trap 'kill "$builder" 2>/dev/null || true' EXIT  # setup or a check failed: no trainer left behind
fi
bash scripts/setup.sh all
bash scripts/check.sh
trap - EXIT  # from here pytest (this same process) owns the build
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
