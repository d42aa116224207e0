"""The awaitables never block the event loop; blocking calls release the GIL for other threads."""

import asyncio
import threading
import time

import pd_bootstrap as pd


def test_awaitables_register_look_up_and_watch(server):
    async def main() -> None:
        client = pd.BootstrapClient(server.url)
        directory = pd.EngineDirectory(client)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        beat = asyncio.ensure_future(ticker())
        assert await client.aregister("p0", 0, 0, 0, "tcp://10.0.0.5:7000") == {"status": "ok"}
        assert (await client.aquery("p0"))[0]["engine_id"] == "p0"
        engine = await directory.aengine(server.url, "p0")
        assert engine.worker(0, 0) == ["tcp://10.0.0.5:7000"]
        async with await client.aregister_leased("p1", 1, 0, 0, "tcp://10.0.0.5:7100", ttl=5) as lease:
            assert lease.alive
            assert len((await client.aworkers())["workers"]) == 2
        assert lease.state == "released"
        updates = client.watch()
        snapshot = await updates.__anext__()
        assert snapshot["kind"] == "snapshot"
        # A watch waiting for the next change leaves the loop free.
        waiting = asyncio.ensure_future(updates.__anext__())
        before = ticks
        await asyncio.sleep(0.2)
        assert ticks - before > 20, "the event loop was blocked"
        await client.aregister("p2", 2, 0, 0, "tcp://10.0.0.5:7200")
        events = await asyncio.wait_for(waiting, 5)
        assert events["kind"] == "events"
        assert any(e["worker"]["engine_id"] == "p2" for e in events["events"]), events
        beat.cancel()
        try:
            await client.aquery("nobody")
        except pd.PdBootstrapError:
            pass

    asyncio.run(main())


def test_blocking_calls_let_other_threads_run(start_server):
    server = start_server("--dp-size", "1", "--tp-size", "2")
    client = pd.BootstrapClient(server.url)
    counted = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal counted
        while not stop.is_set():
            counted += 1

    counter = threading.Thread(target=count)
    counter.start()
    started = time.monotonic()
    try:
        client.wait_ready(0.5)  # never ready: waits the whole 0.5 s with the GIL released
    except pd.PdBootstrapError:
        pass
    waited = time.monotonic() - started
    before = counted
    time.sleep(0.05)
    stop.set()
    counter.join()
    assert waited >= 0.45
    assert before > 10_000, f"the other thread counted only {before} while the call waited"


def test_threads_share_one_client(server):
    client = pd.BootstrapClient(server.url)
    errors = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                client.register(f"t{i}", i, j, 0, f"tcp://10.0.0.5:{10000 + i * 100 + j}")
                client.query(f"t{i}")
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(client.workers()["workers"]) == 160
