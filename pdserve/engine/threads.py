"""Size torch's intra-op thread pool from the CPUs this process may run on.

torch sizes its OpenMP pool from the machine (its physical cores), not from the process's
affinity mask, so under ``taskset -c 0`` or a cpuset it ran two threads on one CPU; their
spin-waiting barriers made decode ~10x slower. The engine sizes the pool itself; an
explicit ``OMP_NUM_THREADS`` still caps it, as it caps torch's own default.
"""

from __future__ import annotations

import os

import torch


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def engine_threads() -> int:
    """:func:`allowed_cpus`, or fewer when ``OMP_NUM_THREADS`` asks for fewer."""
    allowed = allowed_cpus()
    requested = os.environ.get("OMP_NUM_THREADS", "")
    return min(allowed, int(requested)) if requested.isdigit() and int(requested) > 0 else allowed


def configure_torch_threads() -> int:
    """Set torch's intra-op threads to :func:`engine_threads` and return the count now in effect.

    Call it on the thread that runs the model, before that thread's first torch op: OpenMP
    keeps its thread count per thread, and torch hands its setting to another thread only
    on that thread's first parallel op.
    """
    torch.set_num_threads(engine_threads())
    return torch.get_num_threads()
