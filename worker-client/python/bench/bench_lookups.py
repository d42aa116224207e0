"""Benchmark of the Python binding: what a scheduler loop pays per call, and lookups per second
beside httpx making the same calls.

    python worker-client/python/bench/bench_lookups.py [--server target/release/bootstrap-server]

Starts a bootstrap-server on 127.0.0.1 with 64 registered workers, then measures, in one run:
- `submit_lookup()` and `poll()` (a pending and a finished handle): ns per call;
- `GET /query?engine_id=` per second, one at a time from one thread: `BootstrapClient.query`
  against `httpx.Client.get` + `.json()`;
- the same with 8 and 64 in flight from asyncio: `aquery` against `httpx.AsyncClient`;
- `EngineDirectory.engine()` (cached after the first fetch) per second.
Prints a Markdown table.
"""

import argparse
import asyncio
import pathlib
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Callable, List, Tuple

import httpx

import pd_bootstrap as pd

REPO = pathlib.Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def per_second(call: Callable[[], object], seconds: float) -> float:
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        done += 1
    return done / (time.perf_counter() - started)


def ns_per_call(call: Callable[[], object], n: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(n):
        call()
    return (time.perf_counter_ns() - started) / n


async def concurrent_per_second(call: Callable[[], "asyncio.Future[object]"], inflight: int,
                                seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=str(REPO / "target" / "release" / "bootstrap-server"))
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen([args.server, "--host", "127.0.0.1", "--port", str(port),
                                   "--data-dir", data], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.05)
            rows = run(url, args.seconds)
        finally:
            server.terminate()
            server.wait()
    print("| measure | pd_bootstrap | httpx |")
    print("|---|---|---|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours} | {theirs} |")


def run(url: str, seconds: float) -> List[Tuple[str, str, str]]:
    client = pd.BootstrapClient(url)
    for tp in range(64):
        client.register("bench", 0, tp, 0, f"tcp://10.0.0.5:{20000 + tp}")
    directory = pd.EngineDirectory(client)
    rows: List[Tuple[str, str, str]] = []

    pending_handle = pd.EngineDirectory(pd.BootstrapClient(f"http://127.0.0.1:{free_port()}")) \
        .submit_lookup(url, "bench", timeout=60)
    done_handle = directory.submit_lookup(url, "bench")
    while directory.poll(done_handle) is None:
        time.sleep(0.001)
    rows.append(("`submit_lookup()` (cached engine), ns/call",
                 f"{ns_per_call(lambda: directory.submit_lookup(url, 'bench'), 20_000):,.0f}", "-"))
    rows.append(("`poll()` of a pending lookup, ns/call",
                 f"{ns_per_call(lambda: directory.poll(pending_handle), 200_000):,.0f}", "-"))
    rows.append(("`poll()` of a finished lookup, ns/call",
                 f"{ns_per_call(lambda: directory.poll(done_handle), 200_000):,.0f}", "-"))

    path = f"{url}/query?engine_id=bench"
    with httpx.Client() as http:
        theirs = per_second(lambda: http.get(path).json(), seconds)
    ours = per_second(lambda: client.query("bench"), seconds)
    rows.append(("`GET /query?engine_id=` one at a time, calls/s", f"{ours:,.0f}", f"{theirs:,.0f}"))

    async def concurrent(inflight: int) -> Tuple[float, float]:
        limits = httpx.Limits(max_connections=inflight, max_keepalive_connections=inflight)
        async with httpx.AsyncClient(limits=limits) as http:
            async def theirs_call() -> object:
                return (await http.get(path)).json()
            theirs = await concurrent_per_second(theirs_call, inflight, seconds)  # type: ignore[arg-type]
        ours = await concurrent_per_second(lambda: client.aquery("bench"), inflight, seconds)  # type: ignore[arg-type,return-value]
        return ours, theirs

    for inflight in (8, 64):
        ours, theirs = asyncio.run(concurrent(inflight))
        rows.append((f"`GET /query?engine_id=`, {inflight} in flight (asyncio), calls/s",
                     f"{ours:,.0f}", f"{theirs:,.0f}"))
    rows.append(("`EngineDirectory.engine()` (cached), calls/s",
                 f"{per_second(lambda: directory.engine(url, 'bench'), seconds):,.0f}", "-"))
    return rows


if __name__ == "__main__":
    main()
