"""The step contract: what the scheduler asks of the model in one step, what the model gives
back, and what applying it did.

A step is ``out = scheduler.schedule(now)`` -> the runner calls the model once for ``out`` and
returns a ``ModelOutput`` -> ``scheduler.update(out, model_output, now)`` (or
``scheduler.fail(out, error, now)``), which returns a ``StepOutcome``. ``update`` is the only
place a request's tokens and state change after a model call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.types import Sequence
from app.models.protocol import Logprobs, PrefillChunk


@dataclass(slots=True)
class SchedulerOutput:
    """One step's schedule.

    - ``decode_seqs``: running requests past their prefill, in slot order; each is fed its last
      generated token (``decode_tokens[i]``, read when first asked for: a stateless model never
      needs it) and gets one new token. ``decode_inputs[i]`` is ``decode_seqs[i].tokens`` (the
      same list: what a stateless model reads). Both lists are shared between steps while they
      do not change: never modify them.
    - ``prefill_seqs[i]`` is fed ``prefills[i]``: a chunk of its prompt (or, after a preemption,
      of prompt + generated tokens) starting at ``prefills[i].start`` (0: the slot's cache starts
      fresh); a chunk with ``sample`` set completes the prefill and gets one new token.
    - ``released``: slots freed since the last step (their caches must be reset before use).
    - ``admitted``: requests that entered a slot in this step for the first time; ``resumed``:
      preempted requests that got a slot again; ``preempted``: requests preempted in this step.
    - ``num_prefill_tokens`` (prompt or recomputed tokens fed) and ``num_decode_tokens``
      (requests fed their last generated token) drive the step clock and the metrics.
    - ``prefix_queries`` / ``prefix_hits``: tokens of the requests admitted or resumed in this
      step looked up in the prefix cache, and those found there (not prefilled).
    - ``lora_loads``: LoRA adapters this step loads into an adapter slot (the step clock may
      charge them).
    """

    decode_seqs: list[Sequence]
    decode_inputs: list[list[int]]
    started_at: float = 0.0
    decodes_plain: bool = True  # every decode request samples plainly (``SamplingParams``)
    decodes_constrained: bool = False  # a decode request has a grammar
    # the prefill chunks, counted as the scheduler plans them: how many sample; whether the
    # request of every chunk samples plainly, and whether one has a grammar (both over all the
    # chunks, also those that sample nothing or that a runner skips: a runner reads the rows
    # it runs when ``prefills_plain`` is False)
    num_sampling_prefills: int = 0
    prefills_plain: bool = True
    prefills_constrained: bool = False
    num_prefill_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    remote_tokens: int = 0  # prompt tokens of admitted requests whose KV a producer sent
    lora_loads: int = 0  # LoRA adapters loaded into the batch's adapter slots in this step
    _decode_tokens: list[int] | None = None
    # filled by the scheduler as it plans the step (made empty in ``__post_init__``: list
    # literals cost half what six ``default_factory`` calls do, and one is built every step)
    prefill_seqs: list[Sequence] = field(init=False)
    prefills: list[PrefillChunk] = field(init=False)
    released: list[int] = field(init=False)
    admitted: list[Sequence] = field(init=False)
    resumed: list[Sequence] = field(init=False)
    preempted: list[Sequence] = field(init=False)

    def __post_init__(self) -> None:
        self.prefill_seqs, self.prefills, self.released = [], [], []
        self.admitted, self.resumed, self.preempted = [], [], []

    @property
    def decode_tokens(self) -> list[int]:
        if self._decode_tokens is None:
            self._decode_tokens = [seq.tokens[-1] for seq in self.decode_seqs]
        return self._decode_tokens

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_seqs)

    @property
    def num_outputs(self) -> int:
        """Tokens the model must return: one per decode, one per sampling prefill chunk."""
        return len(self.decode_seqs) + self.num_sampling_prefills

    @property
    def empty(self) -> bool:
        """Nothing to run: no model call is made for this output."""
        return not self.decode_seqs and not self.prefills

    def scheduled(self) -> list[Sequence]:
        """Every request the step feeds tokens to."""
        return [*self.decode_seqs, *self.prefill_seqs]


@dataclass(slots=True)  # (not frozen: a frozen one costs a microsecond a step to build)
class ModelOutput:
    """The model's answer to one ``SchedulerOutput``: ``tokens`` has one id per decode request,
    in order, then one per prefill chunk with ``sample`` set, in order. A partial chunk adds
    nothing.

    ``logprobs`` and ``prompt_logprobs``: as the model's ``StepResult`` gave them (None when no
    request of the step asked).

    ``unavailable_slots``: slots whose cache the model failed to reset, even when retried. They
    are out of service until a later retry succeeds; a fresh chunk scheduled on one was not run
    (and has no token here): its request goes back to the queue and loses nothing.
    """

    tokens: list[int]
    unavailable_slots: frozenset[int] = frozenset()
    logprobs: list[Logprobs | None] | None = None  # aligned with tokens, when asked for
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None  # see StepResult

    def ran(self, chunk: PrefillChunk) -> bool:
        """Whether ``chunk`` was run (not skipped for an unavailable slot)."""
        return not (chunk.fresh and chunk.slot in self.unavailable_slots)


@dataclass(slots=True)
class StepOutcome:
    """What applying one step did (for metrics and logs).

    ``finished``: requests the step ended. ``num_generated``: tokens added to the output of
    requests still running when the call returned (a token for a request aborted during the
    call is dropped, and so is a stop token left out of the output, as in ``usage``).
    ``num_decode_generated``: the part of it from decode requests (each continues from the
    previous step, so it is one inter-token gap). ``error``: set if the model call failed.
    """

    output: SchedulerOutput
    ended_at: float
    finished: list[Sequence] = field(default_factory=list)
    num_generated: int = 0
    num_decode_generated: int = 0
    error: BaseException | None = None
