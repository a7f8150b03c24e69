#!/usr/bin/env bash
# The README's test command: install what is missing (idempotent), then the static checks
# (seconds, so a lint or layering slip fails before the minutes of tests), then the whole suite.
# Extra arguments go to pytest (e.g. `make test ARGS="-k spec"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh system
bash scripts/setup.sh main

# Most tests need the tiny model, and on a fresh clone training it is minutes of CPU. Start it
# now so it overlaps the engine venv's install and the checks; the suite's fixture waits on the
# build's lock (pipeline/stages/tiny_model.build) and reuses what it published. A cached model
# makes this a no-op; whatever is still running when this script exits is stopped.
home=${MODEL_RELEASE_HOME:-.model-release}
mkdir -p "$home/logs"
echo "test: tiny model prebuild in the background (log: $home/logs/tiny-model-build.log)"
.venv/bin/python -m pipeline.cli make-tiny-model >"$home/logs/tiny-model-build.log" 2>&1 &
prebuild=$!
trap 'kill "$prebuild" 2>/dev/null || true' EXIT

bash scripts/setup.sh serve
bash scripts/check.sh
.venv/bin/python -m pytest -ra --durations=25 "$@"
