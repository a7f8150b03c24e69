#!/usr/bin/env bash
# The README's main command: install what is missing (idempotent), then release the tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
# the newcomer's clock starts here, before the setup (pipeline/embedded/demo.py records command -> live)
export MODEL_RELEASE_DEMO_STARTED=$(date +%s.%N)
bash scripts/setup.sh demo
exec .venv/bin/python -m pipeline.embedded.demo "$@"
