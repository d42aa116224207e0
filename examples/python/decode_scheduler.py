"""A D worker's lookups inside a scheduler loop that must never wait on the network.

Each step of a vLLM-style scheduler takes the new requests, submits a lookup for every remote
engine it has not resolved yet (returns in microseconds), and polls the pending ones (never
waits): a request is scheduled once its engine is known, failed once its lookup failed, and
otherwise stays waiting while the loop goes on.

    python examples/python/decode_scheduler.py --bootstrap http://127.0.0.1:8998 \\
        --engine-id prefill-py --requests 100
"""

import argparse
import time
from typing import Dict, List

import pd_bootstrap as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--engine-id", required=True, help="the remote P engine's id")
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()

    directory = pd.EngineDirectory(pd.BootstrapClient(args.bootstrap))
    waiting: Dict[int, pd.LookupHandle] = {}
    scheduled: List[int] = []
    failed: List[int] = []
    step_us: List[float] = []
    next_request = 0
    while len(scheduled) + len(failed) < args.requests:
        started = time.perf_counter()
        # New requests arrive: start their lookups (the directory shares one fetch among them).
        for _ in range(min(10, args.requests - next_request)):
            waiting[next_request] = directory.submit_lookup(args.bootstrap, args.engine_id, timeout=5.0)
            next_request += 1
        # Poll every waiting lookup; none of this waits.
        handles = list(waiting.items())
        for (request, _), outcome in zip(handles, directory.poll_many([h for _, h in handles])):
            if isinstance(outcome, pd.EngineInfo):
                scheduled.append(request)  # here: pull from outcome.worker(dp, tp)
                del waiting[request]
            elif isinstance(outcome, pd.PdBootstrapError):
                failed.append(request)
                del waiting[request]
        step_us.append((time.perf_counter() - started) * 1e6)
        time.sleep(0.001)  # the rest of the step: the model's forward pass
    step_us.sort()
    print(f"scheduled {len(scheduled)}, failed {len(failed)}; scheduler step: "
          f"median {step_us[len(step_us) // 2]:.1f} us, max {step_us[-1]:.1f} us", flush=True)


if __name__ == "__main__":
    main()
