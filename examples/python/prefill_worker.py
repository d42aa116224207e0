"""A P worker's start-up, as a vLLM worker process would do it with pd_bootstrap.

Registers the worker's (dp, tp, pp) rank with the bootstrap server under a lease kept alive in
the background, waits until every expected rank of the engine has registered, then runs until
SIGTERM/SIGINT and revokes the lease on the way out (a kill -9 leaves the registry one ttl
later by itself).

    python examples/python/prefill_worker.py --bootstrap http://127.0.0.1:8998 \\
        --engine-id prefill-py --tp-rank 0 --addr tcp://127.0.0.1:17000
"""

import argparse
import signal
import threading

import pd_bootstrap as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True, help="the bootstrap server's URL")
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--pp-rank", type=int, default=0)
    parser.add_argument("--addr", required=True, help="where D pulls this worker's KV")
    parser.add_argument("--ttl", type=int, default=10, help="lease seconds")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--wait-ready", type=float, default=0.0,
                        help="seconds to wait for the whole topology (0: do not wait)")
    args = parser.parse_args()

    client = pd.BootstrapClient(args.bootstrap, register_deadline=60.0)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with client.register_leased(
        args.engine_id, args.dp_rank, args.tp_rank, args.pp_rank, args.addr, args.ttl,
        replace=True, meta={"model": args.model},
    ) as lease:
        print(f"registered {args.engine_id} dp={args.dp_rank} tp={args.tp_rank} "
              f"under lease {lease.lease_id}", flush=True)
        if args.wait_ready > 0:
            status = client.wait_ready(args.wait_ready)
            print(f"topology complete: {status['registered']} ranks", flush=True)
        while not stop.wait(1.0):
            if lease.state == "failed":
                raise SystemExit("the server refused to register this worker again")
    print("lease revoked", flush=True)


if __name__ == "__main__":
    main()
