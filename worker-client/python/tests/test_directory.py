"""D's lookups: cached, following restarts, and submitted/polled without ever blocking."""

import statistics
import time

import pd_bootstrap as pd


def test_a_restarted_engine_with_a_pinned_id_is_picked_up_within_a_second(server):
    client = pd.BootstrapClient(server.url)
    client.register("p0", 0, 0, 0, "tcp://10.0.0.5:7000")
    directory = pd.EngineDirectory(client)
    first = directory.engine(server.url, "p0")
    assert first.worker(0, 0) == ["tcp://10.0.0.5:7000"]
    # P restarts with the same engine id on a new port: a takeover, a new incarnation.
    client.register("p0", 0, 0, 0, "tcp://10.0.0.5:9000")
    restarted = time.monotonic()
    while directory.engine(server.url, "p0").worker(0, 0) != ["tcp://10.0.0.5:9000"]:
        assert time.monotonic() - restarted < 1.0, "the cache kept the old address"
        time.sleep(0.02)
    assert directory.engine(server.url, "p0").incarnation != first.incarnation


def test_engine_info_describes_the_engine(server):
    client = pd.BootstrapClient(server.url)
    for tp in range(2):
        client.register("p0", 0, tp, 0, f"tcp://10.0.0.5:{7000 + tp}", meta={"model": "m", "tp_size": 2})
    engine = pd.EngineDirectory(client).engine(server.url, "p0")
    assert engine.engine_id == "p0" and engine.tp_size == 2
    assert engine.dp_ranks == {0: {0: {0: "tcp://10.0.0.5:7000"}, 1: {0: "tcp://10.0.0.5:7001"}}}
    assert engine.meta["model"] == "m"
    assert engine.worker(3, 0) is None


def test_a_thousand_submitted_lookups_never_block_the_caller(server):
    client = pd.BootstrapClient(server.url)
    for e in range(10):
        client.register(f"p{e}", e, 0, 0, f"tcp://10.0.0.5:{7000 + e}")
    directory = pd.EngineDirectory(client)
    submit_us, handles = [], []
    for i in range(1000):
        engine_id = f"p{i % 10}" if i % 100 else "missing"
        started = time.perf_counter()
        handles.append(directory.submit_lookup(server.url, engine_id, timeout=5.0))
        submit_us.append((time.perf_counter() - started) * 1e6)
    poll_us = []
    deadline = time.monotonic() + 10
    while True:
        started = time.perf_counter()
        results = directory.poll_many(handles)
        poll_us.append((time.perf_counter() - started) * 1e6 / len(handles))
        if all(r is not None for r in results):
            break
        assert time.monotonic() < deadline, "lookups did not finish"
        time.sleep(0.001)
    for i, result in enumerate(results):
        if i % 100:
            assert isinstance(result, pd.EngineInfo) and result.engine_id == f"p{i % 10}"
        else:
            assert isinstance(result, pd.NotFound)
    # Each call returns in microseconds: medians far below a network round trip.
    assert statistics.median(submit_us) < 500, statistics.median(submit_us)
    assert statistics.median(poll_us) < 50, statistics.median(poll_us)
    # poll() of one handle: the engine, or the exception raised.
    assert directory.poll(handles[1]).engine_id == "p1"
    try:
        directory.poll(handles[0])
        raise AssertionError("a failed lookup polled as found")
    except pd.NotFound:
        pass
    assert handles[0].done()
    # Once the engines are cached, a submitted lookup is answered before submit returns.
    assert directory.submit_lookup(server.url, "p3").done()


def test_a_submitted_lookup_is_bounded_by_its_timeout():
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    directory = pd.EngineDirectory(pd.BootstrapClient(url))
    handle = directory.submit_lookup(url, "p0", timeout=0.3)
    assert directory.poll(handle) is None
    time.sleep(0.6)
    try:
        directory.poll(handle)
        raise AssertionError("a lookup of a silent server succeeded")
    except pd.Timeout:
        pass
    silent.close()
