#!/usr/bin/env bash
# The README's test command: installs what the tests need (Python packages, Debian's redis-server)
# and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
      || echo "warning: could not install redis-server; tests that need Redis will fail" >&2
  else
    echo "redis-server is missing: install Debian's redis-server package" >&2
  fi
fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q tests research/tests "$@"
