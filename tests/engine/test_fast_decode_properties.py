"""Property: the scheduler's fast decode path (when every request shares one stop set and none
needs the end rules for every token, a step's tokens are appended at C speed; then only the
rows given a stop token and those at their last token, found from a heap of deadlines, are
taken back through the end rules) gives every request the tokens a sequential run gives it
alone. Scenarios mix stop sets that the mock language samples or
never samples, requests that need the end rules for every token (a stop condition), aborts
and preemptions before a step or during its model call, failed model calls, the prefix cache
and KV pressure (preemption and re-admission move a request's deadline)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.engine.core import EngineConfig, EngineCore
from app.engine.runner import make_runner
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage

VOCAB = 12
STOP = 3  # the token the mock language samples to stop (with probability 0.1)
LANGUAGE = MockLanguage(text=False, vocab_size=VOCAB, stop_token=STOP, stop_probability=0.1)
REFERENCE_MODEL = MockModel(LANGUAGE)
STOP_SETS = [frozenset(), frozenset({7}), frozenset({STOP}), frozenset({STOP, 5})]
MAX_STEPS = 1_000


class TokenStop:
    """A stop condition (as stop strings are) met by ``token``, which is kept: the request
    needs the end rules for every token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def feed(self, tokens: list[int]) -> bool:
        return self.token in tokens


BLOCK_SIZE = 2  # KV block size of the cached scenarios


@dataclass(frozen=True)
class Spec:
    prompt: list[int]
    max_tokens: int
    stops: frozenset[int]
    include_stop: bool
    stop_on: int | None  # a ``TokenStop`` token (None: no stop condition)
    arrival: int  # the step before which it is submitted


@dataclass(frozen=True)
class Scenario:
    num_slots: int
    cached: bool  # a model with a KV cache (and the prefix cache on)
    extra_blocks: int | None  # KV blocks beyond the longest request's (None: no KV limit)
    specs: list[Spec]
    # step -> (what, request index, during the model call?); what: abort / preempt / fail
    events: dict[int, list[tuple[str, int, bool]]]

    def kv_cache_tokens(self) -> int | None:
        if self.extra_blocks is None:
            return None
        longest = max(len(s.prompt) + s.max_tokens for s in self.specs)
        return max(longest + self.extra_blocks, BLOCK_SIZE)  # (the books need one whole block)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    n = draw(st.integers(1, 6))
    shared = draw(st.sampled_from(STOP_SETS))
    mixed = draw(st.booleans())  # per-request stop sets (the fast path must be left)
    specs = [
        Spec(
            draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)),
            draw(st.integers(0, 10)),
            draw(st.sampled_from(STOP_SETS)) if mixed else shared,
            draw(st.booleans()),
            draw(st.sampled_from([None, None, None, 5])),
            draw(st.integers(0, 5)),
        )
        for _ in range(n)
    ]
    event = st.tuples(
        st.sampled_from(["abort", "preempt", "fail"]), st.integers(0, n - 1), st.booleans()
    )
    return Scenario(
        num_slots=draw(st.integers(1, 4)),
        cached=draw(st.booleans()),
        extra_blocks=draw(st.none() | st.integers(0, 4)),
        specs=specs,
        events=draw(st.dictionaries(st.integers(0, 25), st.lists(event, max_size=2))),
    )


def alone(spec: Spec) -> list[int]:
    """``spec``'s tokens when it runs by itself, one model call per token."""
    prefix, generated = list(spec.prompt), list[int]()
    while len(generated) < spec.max_tokens:
        (token,) = REFERENCE_MODEL.next_tokens([list(prefix)])
        if token in spec.stops:
            if spec.include_stop:
                generated.append(token)
            break
        generated.append(token)
        prefix.append(token)
        if token == spec.stop_on:
            break
    return generated


def run(s: Scenario) -> None:
    model = CachedMockModel(s.num_slots, LANGUAGE) if s.cached else MockModel(LANGUAGE)
    config = EngineConfig(
        num_slots=s.num_slots,
        max_waiting=len(s.specs),
        block_size=BLOCK_SIZE,
        kv_cache_tokens=s.kv_cache_tokens(),
        enable_prefix_caching=s.cached,
    )
    core = EngineCore(make_runner(model, s.num_slots), config)
    seqs: list[Sequence | None] = [None] * len(s.specs)
    cut: set[int] = set()  # aborted, or failed with a model call

    def interfere(step: int, in_call: bool) -> bool:
        """This step's events; True if its model call fails."""
        fails = False
        for what, i, during in s.events.get(step, []):
            seq = seqs[i]
            if during != in_call or seq is None or seq.finished:
                continue
            if what == "abort":
                core.abort(seq.request_id)
                cut.add(i)
            elif what == "preempt" and seq.status is RequestStatus.RUNNING:
                core.scheduler.preempt(seq, core.clock())
            elif what == "fail" and in_call:
                fails = True
        return fails

    last_arrival = max(spec.arrival for spec in s.specs)
    for step in range(MAX_STEPS):
        for i, spec in enumerate(s.specs):
            if spec.arrival == step:
                stop = None if spec.stop_on is None else TokenStop(spec.stop_on)
                seq = Sequence(
                    f"r{i}", list(spec.prompt), spec.max_tokens, spec.stops,
                    include_stop=spec.include_stop, stop=stop,
                )  # fmt: skip
                core.register(seq)
                core.add(seq)
                seqs[i] = seq
        interfere(step, in_call=False)
        if step > last_arrival and not core.scheduler.has_work():
            break
        out = core.schedule()
        if out.empty:
            continue
        result = core.runner.execute(out)
        if interfere(step, in_call=True):
            cut.update(int(seq.request_id[1:]) for seq in out.scheduled())
            core.fail(out, RuntimeError("injected"))
        else:
            core.update(out, result)
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps")
    for i, (spec, ended) in enumerate(zip(s.specs, seqs, strict=True)):
        assert ended is not None
        expected = alone(spec)
        if i in cut and ended.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            assert ended.generated == expected[: ended.num_generated]
        else:
            assert ended.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert ended.generated == expected
    scheduler = core.scheduler
    assert not scheduler.slots.running()
    # nothing decodes: no count of the fast path's is left over for the next requests
    assert scheduler._off_fast_path == 0


# a request aborted during the model call of its last token, beside one that goes on
ABORT_AT_LAST = Scenario(
    num_slots=2,
    cached=False,
    extra_blocks=None,
    specs=[
        Spec([1, 2], 3, frozenset(), False, None, 0),
        Spec([2, 1], 6, frozenset(), False, None, 0),
    ],
    events={2: [("abort", 0, True)]},
)
# preempted while decoding, re-admitted: its deadline is the re-prefill's
PREEMPT_AND_RESUME = Scenario(
    num_slots=2,
    cached=True,
    extra_blocks=None,
    specs=[
        Spec([1, 2], 6, frozenset({7}), False, None, 0),
        Spec([4], 4, frozenset({7}), False, None, 0),
    ],
    events={2: [("preempt", 0, False), ("preempt", 1, True)]},
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
@example(scenario=ABORT_AT_LAST)
@example(scenario=PREEMPT_AND_RESUME)
def test_the_fast_decode_path_gives_each_request_its_sequential_tokens(
    scenario: Scenario,
) -> None:
    run(scenario)
