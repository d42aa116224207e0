"""The scripts under examples/python, run as a user runs them."""

import re
import subprocess
import sys

import pd_bootstrap as pd
from conftest import REPO, server_binary

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


def test_the_local_cluster_runs_with_its_prefill_workers_registered_from_python(tmp_path):
    bin_dir = server_binary().parent
    run = subprocess.run(
        [str(bin_dir / "pd-cluster"), "--bin-dir", str(bin_dir), "--run-dir", str(tmp_path / "run"),
         "--port", "0", "--once", "--clean", "--register-with-python", sys.executable],
        capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "prefill workers registered from Python" in run.stdout
    # Every demo request was answered through the proxy, P's KV found through the registrations
    # the Python processes made.
    sent = re.search(r"Sending (\d+) requests", run.stdout)
    assert sent and run.stdout.count(" TTFT ") == int(sent.group(1)), run.stdout
    assert "Stopped in" in run.stdout
