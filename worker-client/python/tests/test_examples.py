"""The scripts under examples/python, run as a user runs them."""

import subprocess
import sys

import pd_bootstrap as pd
from conftest import REPO

EXAMPLES = REPO / "examples" / "python"


def test_a_python_prefill_registers_and_a_python_decode_schedules_against_it(server):
    prefill = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "prefill_worker.py"), "--bootstrap", server.url,
         "--engine-id", "prefill-py", "--addr", "tcp://127.0.0.1:17000", "--ttl", "5"],
        stdout=subprocess.PIPE, text=True)
    assert prefill.stdout is not None
    assert prefill.stdout.readline().startswith("registered prefill-py dp=0 tp=0 under lease")
    decode = subprocess.run(
        [sys.executable, str(EXAMPLES / "decode_scheduler.py"), "--bootstrap", server.url,
         "--engine-id", "prefill-py", "--requests", "200"],
        capture_output=True, text=True, timeout=60)
    assert decode.returncode == 0, decode.stderr
    assert decode.stdout.startswith("scheduled 200, failed 0"), decode.stdout
    prefill.terminate()
    assert prefill.wait(timeout=10) == 0
    assert prefill.stdout.read().strip() == "lease revoked"
    client = pd.BootstrapClient(server.url)
    assert client.workers()["workers"] == []
