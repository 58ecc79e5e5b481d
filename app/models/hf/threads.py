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

With the thread count left to the server (``--torch-threads 0``) it is chosen per model call
(``StepThreads``): a call of a few tokens runs on one thread, a larger one on every core.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("slotserve.model")

WAIT_POLICY = "PASSIVE"
SMALL_STEP = 8  # tokens: a model call of at most this many runs on one thread


def prepare_openmp() -> str:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose one; returns the policy torch
    will use and logs when it is too late (torch already imported in this process)."""
    policy = os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if "torch" in sys.modules and policy.upper() == WAIT_POLICY:
        log.debug("torch was imported before the model load: OMP_WAIT_POLICY may not apply")
    return policy


_torch_default: list[int] = []  # torch's own count, read before anything here changed it


def set_threads(threads: int) -> int:
    """Sets torch's intra-op threads to ``threads`` when > 0 (``--torch-threads``), else back
    to torch's own default (a per-call chooser of an earlier load may have left it at 1);
    returns the number torch uses."""
    import torch

    if not _torch_default:
        _torch_default.append(torch.get_num_threads())
    torch.set_num_threads(threads if threads > 0 else _torch_default[0])
    return int(torch.get_num_threads())


class StepThreads:
    """Torch's intra-op thread count chosen per model call when the user left it to the
    server: one thread for a call of at most ``SMALL_STEP`` tokens (a few decode rows), all
    ``cores`` above (docs/benchmarks.md, "Threads and the event loop"). A small call's products
    are too small to share, and each of its ~150 parallel regions would wake a sleeping team
    member; a large call's products do gain from the second core. ``fit`` is called by the
    thread that runs the model, before each call; it sets torch's count only when it changes."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self._current = cores

    def fit(self, tokens: int) -> None:
        """Sets the thread count for a call of ``tokens`` tokens."""
        wanted = 1 if tokens <= SMALL_STEP else self.cores
        if wanted != self._current:
            import torch

            torch.set_num_threads(wanted)
            self._current = wanted


def step_threads(threads: int, used: int) -> StepThreads | None:
    """The per-call chooser when ``--torch-threads`` is 0 and torch has several cores (``used``
    threads); None when the user fixed the count or there is one core."""
    return StepThreads(used) if threads == 0 and used > 1 else None
