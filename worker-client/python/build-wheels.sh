#!/usr/bin/env bash
# Release wheels of the pd_bootstrap package for Linux x86_64 and aarch64: one abi3 wheel per
# architecture (CPython >= 3.9), manylinux2014 (glibc >= 2.17), cross-linked with zig so one
# x86_64 machine builds both.
#
#   worker-client/python/build-wheels.sh [x86_64|aarch64 ...]   # default: both
#
# Needs rustup (it adds the Rust targets) and python3 with venv; maturin and ziglang are
# installed from PyPI into target/py-venv. The wheels land in target/wheels/release/.
set -euo pipefail
package="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$package/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}"
venv="$target/py-venv"
out="$target/wheels/release"
arches=("$@")
[[ ${#arches[@]} -gt 0 ]] || arches=(x86_64 aarch64)

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.7,<2" ziglang
export PATH="$venv/bin:$PATH"

for arch in "${arches[@]}"; do
  case "$arch" in
    x86_64 | aarch64) triple="$arch-unknown-linux-gnu" ;;
    *) echo "unknown architecture '$arch' (x86_64 or aarch64)" >&2; exit 2 ;;
  esac
  rustup target add "$triple" >/dev/null
  maturin build --release --manifest-path "$package/Cargo.toml" --target "$triple" --zig \
    --compatibility manylinux2014 --strip --out "$out"
done
ls -l "$out"
