#!/usr/bin/env bash
# The README's main command: install what is missing (idempotent), then release the tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh all
exec .venv/bin/python -m pipeline.embedded.demo "$@"
