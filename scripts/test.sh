#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets itself up, lints, runs every test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
GRPO_EXTRAS=dev,dashboards,trl bash scripts/setup.sh
bash scripts/setup-frameworks.sh   # verl + OpenRLHF in .venv-frameworks (their transformers pin differs)
.venv/bin/ruff check .
.venv/bin/python -m mypy   # the package's type hints ([tool.mypy] in pyproject.toml)
.venv/bin/python -m pytest -q "$@"
