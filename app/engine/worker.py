"""The model's worker thread: model calls that block run here, one at a time, in order.

It is a daemon thread, not a ``ThreadPoolExecutor``: the interpreter joins an executor's threads
at exit, so a model call that never returns would keep a stopped server alive forever. A call
abandoned by ``Engine.stop()`` is left to the thread, which dies with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class ModelWorker:
    """Runs callables on one daemon thread; ``await run(fn, *args)`` gives the result."""

    def __init__(self, name: str = "slotserve-model") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, args, loop, future))
        return await future

    def shutdown(self) -> None:
        """Let the thread end after the job it is running (if that ever returns)."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, loop, future = job
            try:
                result = fn(*args)
            except BaseException as err:  # handed to the awaiting task, which decides
                _deliver(loop, future, None, err)
            else:
                _deliver(loop, future, result, None)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: object,
    error: BaseException | None,
) -> None:
    def settle() -> None:
        if future.done():  # the awaiting task was cancelled (stop() abandoned the call)
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)
