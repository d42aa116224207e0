"""Every exception type, each from the situation that raises it."""

import http.server
import os
import socket
import threading
import time

import pytest

import pd_bootstrap as pd


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_is_unavailable_and_retryable():
    client = pd.BootstrapClient(f"http://127.0.0.1:{closed_port()}", call_deadline=0.3)
    with pytest.raises(pd.Unavailable) as raised:
        client.topology()
    assert raised.value.retryable and raised.value.status is None
    assert "127.0.0.1" in (raised.value.url or "")


def test_a_silent_server_times_out_within_the_request_timeout():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections, never answers
    port = silent.getsockname()[1]
    client = pd.BootstrapClient(f"http://127.0.0.1:{port}", request_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(pd.Timeout):
        client.topology()
    assert time.monotonic() - started < 2
    silent.close()


def test_a_conflict_is_rejected_with_the_servers_words(server):
    client = pd.BootstrapClient(server.url)
    client.register("e1", 0, 0, 0, "tcp://10.0.0.5:7000")
    with pytest.raises(pd.Rejected) as raised:
        client.register("e2", 0, 0, 0, "tcp://10.0.0.6:7000", replace=False)
    assert raised.value.status == 400 and not raised.value.retryable
    assert "e1" in (raised.value.detail or "")


def test_a_missing_token_is_unauthorized(start_server):
    server = start_server("--auth-token", "s3cret")
    with pytest.raises(pd.Unauthorized) as raised:
        pd.BootstrapClient(server.url).register("e1", 0, 0, 0, "tcp://10.0.0.5:7000")
    assert raised.value.status == 401
    assert isinstance(raised.value, pd.Rejected)
    pd.BootstrapClient(server.url, token="s3cret").register("e1", 0, 0, 0, "tcp://10.0.0.5:7000")


def test_an_unknown_engine_is_not_found(server):
    directory = pd.EngineDirectory(pd.BootstrapClient(server.url))
    with pytest.raises(pd.NotFound):
        directory.engine(server.url, "nobody")


def test_bad_arguments_are_invalid_input(server):
    with pytest.raises(pd.InvalidInput):
        pd.BootstrapClient("not a url")
    with pytest.raises(pd.InvalidInput):
        pd.BootstrapClient(server.url, request_timeout=-1)
    with pytest.raises(pd.InvalidInput):
        pd.BootstrapClient(server.url).register_leased("e1", 0, 0, 0, "tcp://10.0.0.5:7000", ttl=0)


def test_a_different_layout_is_incompatible(server):
    client = pd.BootstrapClient(server.url)
    client.register("e1", 0, 0, 0, "tcp://10.0.0.5:7000", meta={"model": "llama", "kv_cache_dtype": "fp8"})
    directory = pd.EngineDirectory(client, meta={"kv_cache_dtype": "bfloat16"})
    with pytest.raises(pd.Incompatible) as raised:
        directory.engine(server.url, "e1")
    assert (raised.value.field, raised.value.local, raised.value.remote) == ("kv_cache_dtype", "bfloat16", "fp8")


class NotJson(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"this is not the protocol")

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_off_the_protocol_is_a_protocol_error():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), NotJson)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(pd.ProtocolError):
            pd.BootstrapClient(f"http://127.0.0.1:{httpd.server_address[1]}").workers()
    finally:
        httpd.shutdown()


def test_use_after_fork_raises_a_clear_error_in_the_child(server):
    client = pd.BootstrapClient(server.url)
    client.topology()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            client.topology()
        except pd.ForkError:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_every_error_is_a_pd_bootstrap_error():
    for kind in (pd.Unavailable, pd.Timeout, pd.Rejected, pd.Unauthorized, pd.NotFound,
                 pd.Incompatible, pd.InvalidInput, pd.ProtocolError, pd.ForkError):
        assert issubclass(kind, pd.PdBootstrapError)


FORK_BEFORE_USE = """
import os, sys, pd_bootstrap as pd
pid = os.fork()
if pid == 0:
    try:
        pd.BootstrapClient(sys.argv[1]).topology()
        os._exit(0)
    except BaseException as err:
        print(repr(err), flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_before_first_use_works(server):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORK_BEFORE_USE, server.url],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
