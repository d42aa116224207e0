"""Runs SGLang's own P/D bootstrap server, for pd-bench's side-by-side SGLang scenarios.

Usage: python sglang_bootstrap.py HOST PORT

Starts `CommonKVBootstrapServer` from the installed `sglang` package (unmodified: the class every
SGLang prefill starts on its bootstrap port) and keeps the process alive until SIGTERM or SIGINT.
The server runs in its own thread, as it does inside a prefill.
"""

import signal
import sys
import threading

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    CommonKVBootstrapServer(host, port)
    stop.wait()


if __name__ == "__main__":
    main()
