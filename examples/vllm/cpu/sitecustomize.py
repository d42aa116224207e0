"""Every Python process of a pd-cluster engine dies with its parent.

pd-cluster starts each vLLM engine with a parent-death signal, but vLLM's API server starts its
engine core, which starts its worker, and those would outlive a launcher killed with SIGKILL
(reparented to init, holding memory and ports). With PD_DIE_WITH_PARENT=1 in the environment,
which pd-cluster sets for its engines, and this folder on PYTHONPATH, Python runs this file at
start-up in each of those processes: each asks the kernel for SIGKILL when its own parent dies,
so the whole chain goes down with the launcher.
"""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1

if os.environ.get("PD_DIE_WITH_PARENT") == "1":
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        # The parent died before the request took effect.
        os._exit(1)
