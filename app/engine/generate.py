"""The seed's synchronous ``generate()``: the scheduling core driven to completion in a loop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import chain
from operator import attrgetter, countOf

from app.engine.errors import ModelError
from app.engine.runner import ModelRunner, close_quietly, make_runner
from app.engine.scheduler import Scheduler
from app.engine.types import Request, Sequence
from app.models.protocol import Model

_REQUEST_ID, _PROMPT = attrgetter("request_id"), attrgetter("prompt")
_MAX_TOKENS = attrgetter("max_tokens")


def generate(
    model: Model,
    requests: list[Request],
    num_slots: int,
    stop_token: int,
    *,
    include_stop: bool = False,
    pad_sequence: list[int] | None = None,
) -> dict[str, list[int]]:
    """Serve ``requests`` with ``num_slots`` batch slots and return each one's generated tokens,
    keyed by ``request_id`` in the order of ``requests``.

    - ``max_tokens`` counts generated tokens only; ``max_tokens == 0`` gives ``[]`` and the
      request never reaches the model.
    - ``stop_token`` ends a request and is left out of its result unless ``include_stop``.
    - Requests enter slots in list order; a slot freed in a step is refilled before the next
      call, so every call carries ``min(num_slots, unfinished requests)`` sequences, or exactly
      ``num_slots`` with ``pad_sequence`` (empty slots padded, their outputs ignored).
    - Bad input raises ``ValueError`` naming the request before any model call. A model that
      breaks its contract raises ``ModelOutputError``; one that raises makes this raise
      ``ModelError`` chained to it. Either carries ``.partial``: every request's tokens so far.
    """
    validate_requests(requests, num_slots, stop_token)
    scheduler = Scheduler(num_slots)
    runner = make_runner(model, num_slots, pad_sequence)
    stops = frozenset((stop_token,))
    # every request's list, in list order, made now and filled as each one ends: made early,
    # the lists have left the garbage collector's young generation before they fill, so its
    # frequent young collections do not walk their tokens (lists made as each request ends
    # cost about ten times the collection time)
    results: dict[str, list[int]] = {r.request_id: [] for r in requests}
    # Each request becomes a ``Sequence`` only when a slot is about to free for it, and is
    # dropped when it ends (its tokens go to ``results``): few objects live at a time.
    arrivals = iter(requests)
    now = time.monotonic()
    _queue(scheduler, arrivals, num_slots, results, now, stops, include_stop)
    try:
        while True:
            out = scheduler.schedule(now)  # a step starts when the previous one ended
            if not (out.decode_seqs or out.prefills):  # ``out.empty`` (read without a call)
                # done, or the model cannot reset a slot: retry, or give up
                if not scheduler.has_work():
                    break
                _recover_slots(runner, scheduler, results)
                now = time.monotonic()
                continue
            try:
                result = runner.execute(out)
            except ModelError as err:  # the model broke its contract
                err.partial = _partial(scheduler, results)
                raise
            except Exception as err:
                raise ModelError(
                    f"model call failed: {err!r}", _partial(scheduler, results)
                ) from err
            now = time.monotonic()
            finished = scheduler.update(out, result, now).finished
            if finished:
                for seq in finished:
                    results[seq.request_id] += seq.tokens[seq.prompt_len :]  # ``generated``
                _queue(scheduler, arrivals, len(finished), results, now, stops, include_stop)
    finally:
        close_quietly(runner)
    return results


def _queue(
    scheduler: Scheduler,
    arrivals: Iterator[Request],
    count: int,
    results: dict[str, list[int]],
    now: float,
    stops: frozenset[int],
    include_stop: bool,
) -> None:
    """Hand the scheduler the next ``count`` requests that need the model, so that every slot
    freed in a step has a request waiting for it (in list order). A request that ends at once
    (``max_tokens == 0``) gets its empty result here."""
    for r in arrivals:  # (a generator of sequences would cost a C-level call each)
        seq = Sequence(r.request_id, list(r.prompt), r.max_tokens, stops, include_stop)
        if scheduler.add(seq, now):
            results[seq.request_id] = seq.generated
            continue
        count -= 1
        if not count:
            return


def validate_requests(requests: list[Request], num_slots: int, stop_token: int) -> None:
    """Raise ``ValueError`` naming the first bad request, or the bad argument. The common case,
    all valid, is checked in a few C-level passes; only a failure looks request by request."""
    if not _is_int(num_slots) or num_slots < 1:
        raise ValueError(f"num_slots must be an integer >= 1, got {num_slots!r}")
    if not _is_int(stop_token):
        raise ValueError(f"stop_token must be an integer, got {stop_token!r}")
    prompts, limits = list(map(_PROMPT, requests)), list(map(_MAX_TOKENS, requests))
    if not (
        len(set(map(_REQUEST_ID, requests))) == len(requests)
        and set(map(type, limits)) <= {int}
        and min(limits, default=0) >= 0
        and set(map(type, prompts)) <= {list}
        and all(prompts)
        and countOf(map(type, chain.from_iterable(prompts)), int) == sum(map(len, prompts))
    ):
        _find_invalid(requests)


def _find_invalid(requests: list[Request]) -> None:
    seen: set[str] = set()
    for request in requests:
        rid = request.request_id
        if rid in seen:
            raise ValueError(f"request {rid!r}: duplicate request_id")
        seen.add(rid)
        if not _is_int(request.max_tokens) or request.max_tokens < 0:
            raise ValueError(f"request {rid!r}: max_tokens must be an integer >= 0")
        if not isinstance(request.prompt, list) or not request.prompt:
            raise ValueError(f"request {rid!r}: prompt must be a non-empty list of token ids")
        bad = [t for t in request.prompt if not _is_int(t)]
        if bad:
            raise ValueError(f"request {rid!r}: prompt token {bad[0]!r} is not an integer")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _recover_slots(
    runner: ModelRunner, scheduler: Scheduler, results: dict[str, list[int]]
) -> None:
    """Nothing could be scheduled: have the model retry its failed slot resets; if a slot is
    still unavailable, raise ``ModelError`` with the partial results (``generate()`` does not
    wait for a model to heal)."""
    unavailable = runner.retry_resets()
    scheduler.slots.set_out_of_service(unavailable)
    if unavailable:
        raise ModelError(
            f"the model failed to reset slots {sorted(unavailable)}", _partial(scheduler, results)
        )


def _partial(scheduler: Scheduler, results: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every request's tokens so far (carried by the error that ends a run): ``results`` for
    the requests that ended or never started, the scheduler's own for the rest."""
    partial = dict(results)
    for seq in [*scheduler.slots.running(), *scheduler.waiting]:
        partial[seq.request_id] = seq.generated
    return partial
