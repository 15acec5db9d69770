#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets itself up, lints, runs every test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
GRPO_EXTRAS=dev,dashboards,trl bash scripts/setup.sh
# verl + OpenRLHF in .venv-frameworks (their transformers pin differs), made in the background at a lower
# priority while the lint and the first tests run; tests/test_integration_frameworks.py waits for it (the
# .pending file holds the set-up's pid, .status its exit code, .log its output)
rm -f .venv-frameworks.status
(
  echo "$BASHPID" > .venv-frameworks.pending
  status=0
  nice -n 10 bash scripts/setup-frameworks.sh > .venv-frameworks.log 2>&1 || status=$?
  echo "$status" > .venv-frameworks.status
  rm -f .venv-frameworks.pending
) &
setup=$!
while [ ! -s .venv-frameworks.pending ] && [ ! -e .venv-frameworks.status ]; do sleep 0.1; done
.venv/bin/ruff check .
.venv/bin/python -m mypy   # the package's type hints ([tool.mypy] in pyproject.toml)
status=0
.venv/bin/python -m pytest -q --durations=20 "$@" || status=$?   # the slowest tests: where the suite's time goes
wait "$setup" || true
exit "$status"
