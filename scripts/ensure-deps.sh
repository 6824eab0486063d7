#!/usr/bin/env bash
# Makes sure the tools the tests and the demo run are installed: redis-server
# and redis-cli (real Redis for every test), promtool (checks the metrics
# exposition), openssl (makes the TLS test's CA), rotel (the OTLP receiver
# the trace test exports to). Installs
# them with apt-get / pip when this machine allows it, else says exactly what
# to run.
set -euo pipefail
if ! python3 -c "import rotel" >/dev/null 2>&1; then
  echo "rotel is missing: installing it (pip install rotel==0.0.1a15)" >&2
  python3 -m pip install -q rotel==0.0.1a15 >/dev/null 2>&1 || {
    echo "error: could not install rotel: pip install rotel==0.0.1a15" >&2
    exit 1
  }
fi
missing=()
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || missing+=(redis-server redis-tools)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
[ ${#missing[@]} -eq 0 ] && exit 0
install="apt-get install -y --no-install-recommends ${missing[*]}"
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "missing: ${missing[*]}: installing ($install)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive $install >/dev/null
    exit 0
  elif sudo -n true 2>/dev/null; then
    echo "missing: ${missing[*]}: installing (sudo $install)" >&2
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive $install >/dev/null
    exit 0
  fi
fi
echo "error: ${missing[*]} not installed and cannot be installed from here." >&2
echo "       Install them, then run this again:  sudo $install" >&2
exit 1
