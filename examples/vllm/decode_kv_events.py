"""Decodes a KV cache event publisher's stream with vLLM's own classes.

    python decode_kv_events.py ENDPOINT TOPIC BATCHES

Subscribes to ENDPOINT (a ZMQ PUB socket, e.g. tcp://127.0.0.1:5557) under TOPIC, prints
`ready`, then decodes BATCHES messages with vLLM's `msgspec` decoder of `KVEventBatch` (what
vLLM's consumers, and llm-d's and Dynamo's routers after them, read) and prints one JSON line
per batch: its event types, and the fields of its first event and of its first BlockStored
event (a batch may begin with removals once the cache is full). A payload vLLM cannot decode
ends the script with status 1 and vLLM's error; none within 10 s, with status 2.
"""

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch


def main() -> int:
    endpoint, topic, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    socket = zmq.Context().socket(zmq.SUB)
    socket.setsockopt(zmq.RCVTIMEO, 10_000)
    socket.setsockopt_string(zmq.SUBSCRIBE, topic)
    socket.connect(endpoint)
    print("ready", flush=True)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    for _ in range(batches):
        try:
            frames = socket.recv_multipart()
        except zmq.Again:
            print("no batch within 10 s", file=sys.stderr)
            return 2
        try:
            batch = decoder.decode(frames[-1])
        except msgspec.ValidationError as err:
            print(f"vLLM cannot decode the batch: {err}", file=sys.stderr)
            return 1
        first = batch.events[0] if batch.events else None
        stored = next((e for e in batch.events if type(e).__name__ == "BlockStored"), None)
        print(
            json.dumps(
                {
                    "types": [type(event).__name__ for event in batch.events],
                    "first": msgspec.to_builtins(first) if first is not None else None,
                    "stored": msgspec.to_builtins(stored) if stored is not None else None,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
