"""Registration, leases, queries and the SGLang calls against the real server, blocking."""

import subprocess
import sys
import textwrap
import time

import pd_bootstrap as pd


def register_engine(client: pd.BootstrapClient, engine_id: str, port: int, tp: int = 2) -> None:
    for rank in range(tp):
        client.register(engine_id, 0, rank, 0, f"tcp://10.0.0.5:{port + rank}")


def test_register_query_and_deregister(server):
    client = pd.BootstrapClient(server.url)
    answer = client.register("e1", 0, 0, 0, "tcp://10.0.0.5:7000", meta={"model": "m"})
    assert answer == {"status": "ok"}
    client.register("e1", 0, 1, 0, "tcp://10.0.0.5:7001")
    # vLLM's /query shape, dp rank -> {engine_id, worker_addr: tp -> pp -> address}, int keys.
    assert client.query("e1") == {0: {"engine_id": "e1", "worker_addr": {
        0: {0: "tcp://10.0.0.5:7000"}, 1: {0: "tcp://10.0.0.5:7001"}}}}
    assert client.topology()[0]["engine_id"] == "e1"
    workers = client.workers()["workers"]
    assert sorted(w["tp_rank"] for w in workers) == [0, 1]
    assert client.deregister("e1", tp_rank=1) == 1
    assert len(client.workers()["workers"]) == 1


def test_leases_keep_registrations_alive_and_release_them(server):
    client = pd.BootstrapClient(server.url)
    with client.register_leased("e1", 0, 0, 0, "tcp://10.0.0.5:7000", ttl=1) as lease:
        assert lease.alive and lease.state == "alive" and lease.lease_id is not None
        time.sleep(2.5)  # longer than the ttl: the keepalives hold it
        assert len(client.workers()["workers"]) == 1
    assert lease.state == "released" and not lease.alive
    assert client.workers()["workers"] == []
    assert lease.release() is False


def run_python(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)


LEASED_AND_SLEEPING = """
    import sys, time, pd_bootstrap as pd
    lease = pd.BootstrapClient(sys.argv[1]).register_leased("e1", 0, 0, 0, "tcp://10.0.0.5:7000", ttl=1)
    print("registered", flush=True)
    time.sleep(60)
"""


def test_a_killed_worker_leaves_when_its_lease_expires(server):
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LEASED_AND_SLEEPING), server.url],
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None and worker.stdout.readline().strip() == "registered"
    client = pd.BootstrapClient(server.url)
    assert len(client.workers()["workers"]) == 1
    worker.kill()
    worker.wait()
    killed = time.monotonic()
    while client.workers()["workers"]:
        assert time.monotonic() - killed < 5, "the dead worker's registration outlived its lease"
        time.sleep(0.1)


def test_interpreter_exit_with_a_live_lease_does_not_hang(server):
    started = time.monotonic()
    done = run_python("""
        import sys, pd_bootstrap as pd
        lease = pd.BootstrapClient(sys.argv[1]).register_leased("e1", 0, 0, 0, "tcp://10.0.0.5:7000", ttl=30)
        w = pd.BootstrapClient(sys.argv[1]).watch()
        next(w)
        print(lease.state)
    """, server.url, timeout=10)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"
    assert time.monotonic() - started < 8


def test_wait_ready_waits_for_the_expected_ranks(start_server):
    server = start_server("--dp-size", "1", "--tp-size", "2")
    client = pd.BootstrapClient(server.url)
    client.register("e1", 0, 0, 0, "tcp://10.0.0.5:7000")
    try:
        client.wait_ready(0.3)
        raise AssertionError("ready with one of two ranks")
    except pd.Timeout as err:
        assert "1 of 2 ranks registered" in str(err), str(err)
    client.register("e1", 0, 1, 0, "tcp://10.0.0.5:7001")
    status = client.wait_ready(5)
    assert status["missing"] == 0 and status["registered"] == 2


def test_sglang_rows_topology_ranks_and_rooms(server):
    client = pd.BootstrapClient(server.url)
    for dp in range(2):
        client.register_route({
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 2, "system_dp_rank": dp, "rank_ip": "10.0.0.5",
            "rank_port": 17000 + dp, "page_size": 64, "kv_cache_dtype": "bfloat16",
        })
    topology = client.sglang_topology()
    assert (topology["dp_size"], topology["attn_tp_size"]) == (2, 1)
    assert client.sglang_rank(1, 0) == {"rank_ip": "10.0.0.5", "rank_port": 17001}
    client.register_dp_rank(42, 1)
    assert client.query_dp_ranks([42, 43]) == {42: 1}


def test_drain_marks_an_engine_and_lifts_the_mark(server):
    client = pd.BootstrapClient(server.url)
    client.register("p0", 0, 0, 0, "tcp://10.0.0.5:7000")
    assert client.drain("p0") == 1
    assert client.workers()["workers"][0]["draining"] is True
    assert client.drain("p0", draining=False) == 1
    assert "draining" not in client.workers()["workers"][0]
    try:
        client.drain("nobody")
        raise AssertionError("an unknown engine was drained")
    except pd.NotFound as err:
        assert err.status == 404 and "nobody" in str(err)
