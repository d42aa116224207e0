"""The registry's watch as an iterator."""

import pd_bootstrap as pd


def test_watch_yields_a_snapshot_then_the_changes(server):
    client = pd.BootstrapClient(server.url)
    client.register("p0", 0, 0, 0, "tcp://10.0.0.5:7000")
    updates = client.watch()
    snapshot = next(updates)
    assert snapshot["kind"] == "snapshot"
    assert [w["engine_id"] for w in snapshot["workers"]] == ["p0"]
    client.register("p1", 1, 0, 0, "tcp://10.0.0.5:7100")
    client.deregister("p0")
    seen = []
    while len(seen) < 2:
        batch = next(updates)
        assert batch["kind"] == "events" and batch["revision"] > snapshot["revision"]
        seen.extend(batch["events"])
    kinds = [(e["type"], e["worker"]["engine_id"]) for e in seen]
    assert kinds == [("put", "p1"), ("delete", "p0")], kinds
    # Resuming from a revision skips the snapshot.
    resumed = client.watch(since=snapshot["revision"])
    assert next(resumed)["kind"] == "events"
