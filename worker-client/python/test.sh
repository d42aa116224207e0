#!/usr/bin/env bash
# Tests of the pd_bootstrap Python package: builds the wheel with maturin into a venv under
# target/, type-checks the examples with mypy --strict and runs pytest against the real
# bootstrap-server binary. Reuses the workspace's debug build (`cargo test` builds the server).
#
#   worker-client/python/test.sh [pytest args...]
#
# Needs python3 (>= 3.9) with venv and network access to PyPI the first time (maturin, pytest,
# httpx, which the tests import, openai, mypy are installed into the venv, which later runs reuse).
set -euo pipefail
package="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$package/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}"
venv="$target/py-venv"

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  "maturin>=1.7,<2" "pytest>=7" "httpx>=0.27" "mypy>=1.10" "openai>=1.40,<3"

server="${PD_BOOTSTRAP_SERVER:-$target/debug/bootstrap-server}"
if [[ ! -x "$server" ]]; then
  (cd "$repo" && cargo build -q -p bootstrap-server --all-features)
fi

wheels="$target/wheels"
rm -rf "$wheels"
"$venv/bin/maturin" build -q --manifest-path "$package/Cargo.toml" --out "$wheels" \
  --interpreter "$venv/bin/python"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
  "$wheels"/pd_bootstrap-*.whl

"$venv/bin/python" -m mypy --strict "$repo/examples/python"
cd "$package"
PD_BOOTSTRAP_SERVER="$server" "$venv/bin/python" -m pytest -q tests "$@"
