#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu machine (root or sudo) or an existing checkout:
# a virtualenv in .venv, the torch CPU wheel FIRST (a bare `torch` requirement pulls a multi-GB CUDA
# build), then the package with its dev extras. Override the torch requirement with GRPO_TORCH.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_REQ="${GRPO_TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "setup: need root or sudo to run: $*" >&2; return 1; fi; }

apt_install() {
  command -v apt-get >/dev/null || { echo "setup: please install: $*" >&2; return 1; }
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v "$PY" >/dev/null; then apt_install python3 python3-venv python3-pip; fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python >= 3.11 is required, found $("$PY" --version 2>&1)" >&2; exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || { apt_install python3-venv && rm -rf .venv && "$PY" -m venv .venv; }
fi
# The real Prometheus, promtool, Alertmanager and amtool for the tests and the demo (Debian packages).
# Their services are not started by the install: the project starts its own on free ports.
if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null || ! command -v openssl >/dev/null; then
  blocker=/usr/sbin/policy-rc.d
  if [ ! -e "$blocker" ] && [ -w /usr/sbin ] ; then printf '#!/bin/sh\nexit 101\n' > "$blocker"; chmod +x "$blocker"; made=1; fi
  apt_install --no-install-recommends prometheus prometheus-alertmanager openssl || status=$?
  [ "${made:-0}" = 1 ] && rm -f "$blocker"
  [ "${status:-0}" = 0 ] || exit "$status"
fi

VPY=.venv/bin/python
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  "$VPY" -m pip install -q "$TORCH_REQ"
fi
# GRPO_EXTRAS: the test suite adds `trl` (the real TRL run); the demo does not need it.
"$VPY" -m pip install -q -e ".[${GRPO_EXTRAS:-dev,dashboards}]"
