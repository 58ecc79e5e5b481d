"""How torch's CPU compute shares the cores with the event loop (docs/benchmarks.md, "Threads").

The model runs on the engine's worker thread; torch parallelizes each op over an OpenMP team
(``--torch-threads``, default: all cores). The event loop (HTTP, SSE streams, /health,
cancels) needs a core now and then while a step computes. With OpenMP's default (active)
waiting, a team member that finishes an op spins until the others arrive at the barrier, so on
2 cores the spinning thread and the event loop fight for the same core and every op's barrier
waits for a descheduled thread. With the passive policy a waiting team member sleeps at once:
the event loop gets the core, and the op's stragglers run instead of spinners.

``OMP_WAIT_POLICY`` is read once, when libgomp starts (the first ``import torch``): the server
sets it before loading the model; a value the user set wins.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("slotserve.model")

WAIT_POLICY = "PASSIVE"


def prepare_openmp() -> str:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose one; returns the policy torch
    will use and logs when it is too late (torch already imported in this process)."""
    policy = os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if "torch" in sys.modules and policy.upper() == WAIT_POLICY:
        log.debug("torch was imported before the model load: OMP_WAIT_POLICY may not apply")
    return policy


def set_threads(threads: int) -> int:
    """Sets torch's intra-op threads when ``threads`` > 0 (``--torch-threads``); returns the
    number torch uses."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())
