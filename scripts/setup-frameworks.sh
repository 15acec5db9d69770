#!/usr/bin/env bash
# The virtualenv for the verl and OpenRLHF adapter tests (.venv-frameworks): kept apart from .venv because verl
# pins transformers < 5.11 and the TRL tests run on the newest transformers TRL admits. Idempotent: a complete
# venv is reused (a stamp holds the hash of what it was made from). Needs python3 >= 3.11 with venv; the torch
# CPU wheel first, as in setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-frameworks
REQ=tests/frameworks/requirements.txt
TORCH_REQ="${GRPO_TORCH:-torch==2.13.0}"
FRAMEWORKS="verl==0.9.1 openrlhf==0.11.2 deepspeed==0.19.8"
stamp="$(cat "$REQ" "$0" | sha256sum | cut -c1-16)"
if [ -f "$VENV/.stamp" ] && [ "$(cat "$VENV/.stamp")" = "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps -e . >/dev/null   # the package itself may have moved
  exit 0
fi
rm -rf "$VENV"
"${PYTHON:-python3}" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q "$TORCH_REQ"
"$VPY" -m pip install -q -r "$REQ"
# shellcheck disable=SC2086
"$VPY" -m pip install -q --no-deps $FRAMEWORKS
"$VPY" -m pip install -q --no-deps -e .
echo "$stamp" > "$VENV/.stamp"
