#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets itself up, lints, runs every test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
