#!/usr/bin/env bash
# Installs SGLang (the pinned release, from PyPI, with its dependencies: torch and the rest, several
# GB) into a virtualenv ("${SGLANG_VENV:-target/bench-sglang-venv}", relative to the repository
# root), so that `pd-bench sglang --sglang-venv DIR` can measure SGLang's own bootstrap server
# (examples/bench/sglang_bootstrap.py) beside pd-bootstrap. Benchmark-only. Re-running is a no-op
# once the pinned version is in. Prints the virtualenv's python.
set -euo pipefail
cd "$(dirname "$0")/../.."

SGLANG_VENV="${SGLANG_VENV:-target/bench-sglang-venv}"
SGLANG_VERSION=0.5.23

if [ ! -x "$SGLANG_VENV/bin/python" ]; then
    python3 -m venv "$SGLANG_VENV"
fi
if ! "$SGLANG_VENV/bin/python" - "$SGLANG_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
sys.exit(version("sglang") != sys.argv[1])
PY
then
    "$SGLANG_VENV/bin/pip" install --quiet --disable-pip-version-check "sglang==$SGLANG_VERSION"
fi
# The server's module imports: a broken install fails here, not in the middle of a run.
"$SGLANG_VENV/bin/python" -c "from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer"
echo "sglang: $(realpath "$SGLANG_VENV/bin/python")"
