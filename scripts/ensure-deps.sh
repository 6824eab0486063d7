#!/usr/bin/env bash
# Makes sure the tools a command needs are installed.
#   scripts/ensure-deps.sh demo   what `make demo` runs: redis-server and
#                                 redis-cli, PostgreSQL's server binaries and psql
#                                 (the demo's sink; without them it writes files)
#   scripts/ensure-deps.sh [test] what the tests run besides: promtool (checks
#                                 the metrics exposition), openssl (the TLS test's
#                                 CA), rotel (the OTLP receiver the trace test
#                                 exports to), Chromium and its WebDriver (the
#                                 console's tests drive a real headless browser)
# Installs them with apt-get / pip when this machine allows it, else says
# exactly what to run. ENSURE_DEPS_DRY_RUN=1: prints what is missing
# (`missing: ...`) and installs nothing.
set -euo pipefail
what=${1:-test}
case "$what" in
  demo|test) ;;
  *) echo "error: unknown set \`$what\`: scripts/ensure-deps.sh demo, or scripts/ensure-deps.sh test" >&2; exit 2 ;;
esac
dry=${ENSURE_DEPS_DRY_RUN:-}
missing=()
# pip_module MODULE PACKAGE WHY: installs PACKAGE when python3 cannot import MODULE.
pip_module() {
  python3 -c "import $1" >/dev/null 2>&1 && return 0
  if [ -n "$dry" ]; then
    missing+=("$1")
    return 0
  fi
  echo "$1 is missing ($3): installing it (pip install $2)" >&2
  python3 -m pip install -q "$2" >/dev/null 2>&1 || {
    echo "error: could not install $1: pip install $2" >&2
    exit 1
  }
}
if [ "$what" = test ]; then
  pip_module rotel rotel==0.0.1a15 "the OTLP receiver of the traces tests"
  pip_module openai openai==3.63.0 "the Batch API test drives serve-batches with it"
fi
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || missing+=(redis-server redis-tools)
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  missing+=(postgresql)
  # Only the binaries: no cluster of the package's own listening on 5432.
  if [ -z "$dry" ]; then
    as_root=""; [ "$(id -u)" = 0 ] || as_root="sudo -n"
    if $as_root true 2>/dev/null; then
      $as_root mkdir -p /etc/postgresql-common
      echo "create_main_cluster = false" | $as_root tee /etc/postgresql-common/createcluster.conf >/dev/null
    fi
  fi
fi
command -v psql >/dev/null 2>&1 || missing+=(postgresql-client)
if [ "$what" = test ]; then
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-dejavu-core)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ -n "$dry" ]; then
  echo "missing: ${missing[*]}"
  exit 0
fi
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
if [ "$what" = demo ] && [ -z "$(printf '%s\n' "${missing[@]}" | grep -v '^postgresql')" ]; then
  echo "warning: PostgreSQL is not installed and cannot be installed from here: the demo writes its results to files instead" >&2
  exit 0
fi
echo "error: ${missing[*]} not installed and cannot be installed from here." >&2
echo "       Install them, then run this again:  sudo $install" >&2
exit 1
