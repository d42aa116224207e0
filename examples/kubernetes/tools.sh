#!/usr/bin/env bash
# tools.sh: make sure the manifests' checks have their tools, and print the venv's path.
#
# - kubectl with kustomize v5 (`kubectl kustomize`). Debian's own kubernetes-client (1.20, an
#   old kustomize) cannot render these manifests; the `kubectl` package (Kubernetes' or Google
#   Cloud's apt repository, preinstalled on this project's machines) can. Installed with apt-get
#   when missing and run as root.
# - a venv with requirements.txt (kubernetes-validate, pinned), made once per version of that
#   file: $1, else $CARGO_TARGET_DIR/k8s-venv, else target/k8s-venv. Needs python3 with venv
#   and PyPI the first time.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:-${CARGO_TARGET_DIR:-$repo/target}/k8s-venv}

if ! command -v kubectl >/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "tools.sh: installing kubectl" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null
  else
    echo "tools.sh: needs kubectl (kustomize v5): apt-get install kubectl" >&2
    exit 1
  fi
fi
kustomize=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v//p')
if [[ ${kustomize%%.*} -lt 5 ]]; then
  echo "tools.sh: kubectl's kustomize is ${kustomize:-unknown}; these manifests need v5 or newer" >&2
  exit 1
fi

stamp="$venv/.complete-$(sha256sum "$here/requirements.txt" | cut -c1-12)"
if [[ ! -f $stamp ]]; then
  rm -rf "$venv"
  echo "tools.sh: installing kubernetes-validate into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
  touch "$stamp"
fi
echo "$venv"
