#!/usr/bin/env bash
# `make docs`: install the docs tools if missing (idempotent), regenerate the pages that come from the
# code and the measurements (scripts/docs_gen.py), then build the site into build/docs/ with
# `mkdocs build --strict` (a broken link or anchor fails). `make docs ARGS=serve` serves it on :8000.
set -euo pipefail
export NO_MKDOCS_2_WARNING=1  # mkdocs-material prints a notice of its successor on every build
cd "$(dirname "$0")/.."
bash scripts/setup.sh docs
.venv/bin/python scripts/docs_gen.py
if [[ ${1:-} == serve ]]; then exec .venv/bin/mkdocs serve --strict; fi
.venv/bin/mkdocs build --strict
echo "docs: site in build/docs/ (open build/docs/index.html)"
