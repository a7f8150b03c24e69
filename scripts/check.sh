#!/usr/bin/env bash
# Static checks, configured in pyproject.toml: ruff (lint + format), the import layering
# contract (import-linter), mypy. Run first by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PATHS=(pipeline dags plugins tests testkit benchmarks scripts)
echo "check: ruff"; .venv/bin/ruff check "${PATHS[@]}"
echo "check: ruff format"; .venv/bin/ruff format --check "${PATHS[@]}"
echo "check: import layers"; .venv/bin/lint-imports
echo "check: mypy"; .venv/bin/mypy && .venv/bin/mypy scripts/docs_gen.py
