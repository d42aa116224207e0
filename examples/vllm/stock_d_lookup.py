"""vLLM's decode-side bootstrap lookup, run as vLLM runs it.

For each bootstrap address read from stdin (one per line), calls vLLM's own
MooncakeConnectorWorker._connect_to_prefiller_bootstrap (the GET {addr}/query a stock D makes
once per unknown engine) on a fresh worker state, and prints one JSON line: the engines it
learned, with the tp size it took for each (what a real D would keep for its life), or {} when
the lookup failed (vLLM logs the error and keeps nothing). examples/tests/real_vllm/registration.rs
replays it between the registrations of a P whose ranks arrive one by one.
"""

import asyncio
import json
import sys
from collections import defaultdict

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorWorker,
)


class DecodeState:
    """The fields of a MooncakeConnectorWorker that the lookup reads and writes."""

    def __init__(self) -> None:
        self._remote_agents: dict = {}
        self._tp_size: dict = {}
        self._pending_bootstrap_queries: dict = defaultdict(asyncio.Event)


async def lookup(addr: str) -> dict:
    state = DecodeState()
    state._pending_bootstrap_queries[addr]
    await MooncakeConnectorWorker._connect_to_prefiller_bootstrap(state, addr)
    return {engine: {"tp_size": size, "tp_ranks": sorted(state._remote_agents[engine])}
            for engine, size in state._tp_size.items()}


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        addr = line.strip()
        if addr:
            print(json.dumps(asyncio.run(lookup(addr))), flush=True)


if __name__ == "__main__":
    main()
