#!/usr/bin/env bash
# The README's test command: installs what the tests need (Python packages, Debian's redis-server and chromium)
# and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } \
      || echo "warning: could not install ${missing[*]}; the tests that need them will fail" >&2
  else
    echo "missing Debian packages: ${missing[*]} (install them: the Redis and dashboard tests need them)" >&2
  fi
fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q tests research/tests "$@"
