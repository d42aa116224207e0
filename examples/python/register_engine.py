"""Registers a running engine's prefill workers from Python, through the pd_bootstrap package.

The pattern of a vLLM deployment whose workers register through the binding: the engine serves
the KV, and its workers' ranks and transfer addresses go to the bootstrap server under leases
the binding keeps alive in the background. Here one process does it for every worker of a
`sim-engine --role prefill --registration external`, whose `GET /stats` lists them. The leases
are revoked on SIGTERM/SIGINT; if this process is killed, they expire one ttl later.

    python examples/python/register_engine.py --engine http://127.0.0.1:8101 \\
        --bootstrap http://127.0.0.1:8998 --ttl 10
"""

import argparse
import contextlib
import json
import signal
import threading
import urllib.request
from typing import Any, Dict, List

import pd_bootstrap as pd


def engine_workers(engine_url: str) -> Dict[str, Any]:
    """The engine's `GET /stats`: `workers` (engine id, ranks, transfer address) and `meta`."""
    with urllib.request.urlopen(f"{engine_url}/stats", timeout=5) as answer:
        stats: Dict[str, Any] = json.load(answer)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="the sim-engine's URL")
    parser.add_argument("--bootstrap", required=True, help="the bootstrap server's URL")
    parser.add_argument("--ttl", type=int, default=10, help="lease seconds")
    args = parser.parse_args()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stats = engine_workers(args.engine)
    workers: List[Dict[str, Any]] = stats["workers"]
    client = pd.BootstrapClient(args.bootstrap, register_deadline=60.0)
    with contextlib.ExitStack() as leases:
        for w in workers:
            leases.enter_context(client.register_leased(
                w["engine_id"], w["dp_rank"], w["tp_rank"], w["pp_rank"], w["addr"], args.ttl,
                replace=True, meta=stats["meta"]))
        print(f"registered {len(workers)} workers of {args.engine} under leases", flush=True)
        stop.wait()
    print("leases revoked", flush=True)


if __name__ == "__main__":
    main()
