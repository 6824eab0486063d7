#!/usr/bin/env bash
# Makes sure redis-server and redis-cli are installed: installs them with
# apt-get when this machine allows it, else says exactly what to run.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
install="apt-get install -y --no-install-recommends redis-server redis-tools"
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "redis-server is missing: installing it ($install)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive $install >/dev/null
    exit 0
  elif sudo -n true 2>/dev/null; then
    echo "redis-server is missing: installing it (sudo $install)" >&2
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive $install >/dev/null
    exit 0
  fi
fi
echo "error: redis-server is not installed and cannot be installed from here." >&2
echo "       Install it, then run this again:  sudo $install" >&2
exit 1
