"""Fixtures: the real bootstrap-server binary on 127.0.0.1, one per test."""

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import tempfile
import threading
from typing import Callable, Iterator, List

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def server_binary() -> pathlib.Path:
    """The bootstrap-server the tests run: $PD_BOOTSTRAP_SERVER, else the workspace's debug build."""
    path = pathlib.Path(os.environ.get("PD_BOOTSTRAP_SERVER", REPO / "target" / "debug" / "bootstrap-server"))
    if not path.exists():
        pytest.fail(f"{path} does not exist: run `cargo build -p bootstrap-server` first")
    return path


class Server:
    """A running bootstrap-server process on 127.0.0.1 and a port the kernel picked."""

    def __init__(self, tmp: pathlib.Path, flags: List[str]) -> None:
        self.process = subprocess.Popen(
            [str(server_binary()), "--host", "127.0.0.1", "--port", "0", "--log-format", "json",
             "--data-dir", tempfile.mkdtemp(prefix="data-", dir=tmp), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            # Engines shown as soon as their ranks are whole (the tests register before they
            # look); a test of the settle window passes --settle, which wins over the variable.
            env={**os.environ, "PD_BOOTSTRAP_SETTLE": "0"},
        )
        self.lines: List[str] = []
        self.port = self._wait_until_listening()
        self.url = f"http://127.0.0.1:{self.port}"
        # Keep draining the log so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_until_listening(self) -> int:
        assert self.process.stdout is not None
        timer = threading.Timer(30, self.process.kill)
        timer.start()
        try:
            for raw in self.process.stdout:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("fields", {}).get("message") == "bootstrap server listening":
                    return int(str(event["fields"]["addr"]).rsplit(":", 1)[1])
        finally:
            timer.cancel()
        raise RuntimeError("bootstrap-server exited before listening:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def start_server(tmp_path: pathlib.Path) -> Iterator[Callable[..., Server]]:
    """Starts servers with extra flags; stops them after the test."""
    servers: List[Server] = []

    def start(*flags: str) -> Server:
        server = Server(tmp_path, list(flags))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    """A server with default flags."""
    return start_server()


@contextlib.contextmanager
def local_cluster(run_dir: pathlib.Path, *flags: str) -> Iterator[str]:
    """A local P/D cluster of simulated engines (`pd-cluster`, no KV events) with `flags`, until
    the block ends: the proxy's URL (http or https) once it runs; stopped with SIGINT after,
    which must exit 0."""
    bin_dir = server_binary().parent
    cluster = subprocess.Popen(
        [str(bin_dir / "pd-cluster"), "--bin-dir", str(bin_dir), "--run-dir", str(run_dir),
         "--port", "0", "--no-kv-events", "--clean", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert cluster.stdout is not None
    url, seen = None, []
    for line in cluster.stdout:
        seen.append(line)
        found = re.match(r"\s+proxy: (https?://\S+)", line)
        url = found.group(1) if found else url
        if line.startswith("Press Ctrl-C"):
            break
    assert url, "".join(seen)
    try:
        yield url
    finally:
        cluster.send_signal(signal.SIGINT)
        rest, _ = cluster.communicate(timeout=30)
        assert cluster.returncode == 0, "".join(seen) + rest
