#!/usr/bin/env bash
# The demo from a fresh clone: set-up (scripts/setup.sh: virtualenv, torch CPU wheel, the package, the Debian
# packages prometheus and prometheus-alertmanager when absent), then `grpo-exporter demo` with the arguments
# given, e.g. --scenario mask-bug (docs/demo.md). Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: setting up (.venv, torch CPU wheel, the package, prometheus, prometheus-alertmanager) ..."
bash scripts/setup.sh
exec .venv/bin/grpo-exporter demo "$@"
