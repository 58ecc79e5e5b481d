"""n > 1: a request's choices prefill their prompt once. Every choice after the first forks from
the first (``Sequence.fork_of``): it waits while the first prefills, then starts from a copy of
the first one's prompt cache and is fed only the last prompt token. These tests check the
schedule (what is fed, in which step), the fallbacks (the first choice ended, was preempted,
asked for prompt log probabilities), the real model's KV copy (a fork's logits equal a full
prefill's), and the API end to end."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import ClientFactory, serving_of

from app.engine.policies import PolicyConfig, PolicyName
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.models.hf import load_model
from app.models.protocol import PrefillChunk, SamplingParams, StepBatch
from app.serving import GenerationParams

PROMPT = [1, 2, 3, 4, 5, 6, 7]


def choices(
    n: int, prompt: list[int] = PROMPT, max_tokens: int = 4, name: str = "c"
) -> list[Sequence]:
    """A request's ``n`` choices: the first, then forks of it."""
    first = Sequence(f"{name}0", list(prompt), max_tokens, frozenset({0}))
    forks = [
        Sequence(f"{name}{i}", list(prompt), max_tokens, frozenset({0}), fork_of=first)
        for i in range(1, n)
    ]
    return [first, *forks]


def scheduler(slots: int = 4, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(slots, share_prompts=True, **config))  # type: ignore[arg-type]


def run(sched: Scheduler, token: int = 9) -> SchedulerOutput:
    out = sched.schedule(0.0)
    if not out.empty:
        sched.update(out, ModelOutput([token] * out.num_outputs), 0.0)
    return out


def test_forks_wait_for_the_first_prefill_then_are_fed_only_the_last_prompt_token() -> None:
    sched = scheduler()
    first, *forks = choices(3)
    for seq in (first, *forks):
        sched.add(seq, 0.0)
    out = sched.schedule(0.0)
    assert out.prefill_seqs == [first] and out.num_prefill_tokens == len(PROMPT)
    assert all(f.status is RequestStatus.WAITING and f.awaits_fork for f in forks)
    sched.update(out, ModelOutput([9]), 0.0)
    assert not any(f.awaits_fork for f in forks)  # the first one decodes: they may start
    out = run(sched)
    assert out.decode_seqs == [first] and out.prefill_seqs == forks
    for fork, chunk in zip(forks, out.prefills, strict=True):
        assert chunk.prefix_slot == first.slot and chunk.start == len(PROMPT) - 1
        assert list(chunk.prefix) == PROMPT[:-1] and chunk.token_ids == PROMPT[-1:]
        assert chunk.sample and fork.fork_of is None  # on its own from now on
    assert out.num_prefill_tokens == 2  # one token per fork: the prompt was prefilled once
    assert out.admitted == forks
    run(sched)
    assert [s.generated for s in (first, *forks)] == [[9, 9, 9], [9, 9], [9, 9]]


def test_a_chunked_first_prefill_keeps_its_forks_waiting_and_others_go_ahead() -> None:
    sched = scheduler(slots=3, max_num_batched_tokens=4)
    first, fork = choices(2)
    other = Sequence("other", [8, 8], 2, frozenset({0}))
    for seq in (first, fork, other):
        sched.add(seq, 0.0)
    out = run(sched)  # 4 of 7 prompt tokens; the fork waits, the next request may start
    assert out.prefill_seqs == [first] and fork.awaits_fork
    out = run(sched)
    assert fork.request_id in sched.waiting and other in out.prefill_seqs
    out = run(sched)  # first decodes now: the fork starts from its cache
    assert fork in out.prefill_seqs and out.prefills[-1].prefix_slot == first.slot


def test_a_fork_whose_first_choice_has_ended_prefills_alone() -> None:
    sched = scheduler()
    first, fork = choices(2, max_tokens=2)
    sched.add(first, 0.0)
    sched.add(fork, 0.0)
    run(sched, token=0)  # the first choice stops at its first token
    assert first.finish_reason is FinishReason.STOP
    out = run(sched)
    assert out.prefill_seqs == [fork] and out.prefills[0].start == 0
    assert out.prefills[0].prefix_slot is None and fork.fork_of is None


def test_choices_of_one_token_do_not_fork_they_prefill_together() -> None:
    """Review: with max_tokens 1 the first choice ends at its first token, so its forks waited
    a step for nothing and then prefilled alone; now they prefill beside it."""
    sched = scheduler()
    first, *forks = choices(3, max_tokens=1)
    for seq in (first, *forks):
        sched.add(seq, 0.0)
    out = run(sched)
    assert out.prefill_seqs == [first, *forks]
    assert all(seq.finish_reason is FinishReason.LENGTH for seq in (first, *forks))


def test_a_fork_of_an_aborted_or_preempted_first_choice() -> None:
    sched = scheduler()
    first, fork, third = choices(3)
    for seq in (first, fork, third):
        sched.add(seq, 0.0)
    run(sched)
    sched.preempt(first, 0.0)  # it recomputes its prompt: the forks wait for it again
    out = sched.schedule(0.0)
    assert out.prefill_seqs == [first] and fork.awaits_fork and third.awaits_fork
    sched.abort(first.request_id, 0.0)  # while the model runs
    sched.update(out, ModelOutput([9]), 0.0)
    out = run(sched)  # its forks prefill alone
    assert out.prefill_seqs == [fork, third]
    assert all(c.start == 0 and c.prefix_slot is None for c in out.prefills)


def test_forking_needs_the_same_prompt_a_live_source_and_no_prompt_logprobs() -> None:
    sched = scheduler()
    first = choices(1)[0]
    sched.add(first, 0.0)
    other_prompt = Sequence("x", [1, 2, 3], 3, frozenset({0}), fork_of=first)
    scored = Sequence("y", list(PROMPT), 3, frozenset({0}), fork_of=first,
                      sampling=SamplingParams(prompt_logprobs=1))  # fmt: skip
    stranger = Sequence("z", list(PROMPT), 3, frozenset({0}),
                        fork_of=Sequence("ghost", list(PROMPT), 3, frozenset()))  # fmt: skip
    for seq in (other_prompt, scored, stranger):
        sched.add(seq, 0.0)
        assert seq.fork_of is None
    off = Scheduler(SchedulerConfig(4))  # a model that cannot share prompts
    first, fork = choices(2)
    off.add(first, 0.0)
    off.add(fork, 0.0)
    assert fork.fork_of is None


def test_with_the_prefix_cache_a_fork_references_the_first_choices_blocks() -> None:
    sched = scheduler(enable_prefix_caching=True, block_size=2, kv_cache_tokens=64)
    first, fork = choices(2)
    sched.add(first, 0.0)
    sched.add(fork, 0.0)
    run(sched)
    out = run(sched)
    assert out.prefills[0].prefix_slot == first.slot
    assert first.prefix is not None and fork.prefix is not None
    shared = [b for b in fork.prefix.blocks if any(b is o for o in first.prefix.blocks)]
    assert len(shared) == (len(PROMPT) - 1) // 2  # every full block of its copied positions
    running = sched.slots.running()
    # the shared blocks count once: 3 shared, first's own 1 (positions 6-7), fork's own 1
    assert sched.books.used(running) == 5


# --- the real model's copy ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_tiny import save_tiny_model, save_tokenizer

    folder = tmp_path_factory.mktemp("tiny-forks")
    save_tokenizer(folder)
    save_tiny_model(folder)
    return folder


@pytest.mark.real_model
def test_a_fork_on_the_real_model_computes_what_a_full_prefill_computes(tiny: Path) -> None:
    import torch

    loaded = load_model(f"hf:{tiny}", dtype="float32", num_slots=3, max_model_len=32,
                        kv_cache_memory=1 << 20)  # fmt: skip
    model, greedy = loaded.model, SamplingParams()
    prompt = [5, 17, 42, 99, 7, 12]
    model.step(StepBatch((), (), (), (), [PrefillChunk(0, prompt, 0, True, greedy, "a")]))
    fork = PrefillChunk(1, prompt[-1:], len(prompt) - 1, True, greedy, "b",
                        tuple(prompt[:-1]), None, prefix_slot=0)  # fmt: skip
    decode = StepBatch([0], [3], [greedy], ["a"], [fork])
    forked = model.step_logits(decode)[1]
    full = model.step_logits(
        StepBatch((), (), (), (), [PrefillChunk(2, prompt, 0, True, greedy, "c")])
    )
    torch.testing.assert_close(forked, full[0], rtol=1e-4, atol=1e-4)
    assert model.cache.lengths[:3] == [len(prompt) + 1, len(prompt), len(prompt)]


# --- review fixes ---------------------------------------------------------------------------------


def test_mlfq_a_fork_never_preempts_its_own_first_choice() -> None:
    """Review: with one slot under MLFQ, the fork preempted its (demoted) first choice, could
    not start (it waits for it), and the slot went back to the first choice, which recomputed
    its context, once per token: 36 preemptions where 3 are plain round robin."""
    config = PolicyConfig(PolicyName.MLFQ, mlfq_quantum=4, mlfq_aging_seconds=0)
    sched = scheduler(slots=1, policy=config)
    first, fork = choices(2, prompt=list(range(1, 33)), max_tokens=40)
    sched.add(first, 0.0)
    sched.add(fork, 0.0)
    steps = preempted = prefilled = 0
    while sched.has_work() and steps < 500:
        out = sched.schedule(float(steps))
        preempted += len(out.preempted)
        prefilled += out.num_prefill_tokens
        steps += 1
        sched.update(out, ModelOutput([7] * out.num_outputs), float(steps))
    assert first.num_generated == fork.num_generated == 40
    assert first.num_preemptions == 0 and preempted <= 3
    assert prefilled < 3 * 32 + 2 * 40  # no recompute loop


def test_a_drain_keeps_the_forks_of_a_running_first_choice() -> None:
    """Review: a drain (SIGTERM) during the first choice's prefill aborted its waiting forks,
    although the request runs and may finish within the grace."""
    sched = scheduler()
    first, fork = choices(2)
    waiting_first, waiting_fork = choices(2, prompt=[9, 9, 9], name="w")
    for seq in (first, fork):
        sched.add(seq, 0.0)
    out = sched.schedule(0.0)  # first prefills; its fork waits for it
    for seq in (waiting_first, waiting_fork):
        sched.add(seq, 0.0)  # (no slot yet: a request that has not started)
    ended = sched.abort_waiting(0.0)
    assert ended == [waiting_first, waiting_fork]  # a fork of a waiting request goes with it
    assert fork.request_id in sched.waiting and not fork.finished
    sched.update(out, ModelOutput([9]), 0.0)
    while sched.has_work():
        run(sched)
    assert fork.finish_reason is FinishReason.LENGTH and fork.num_generated == 4


async def test_data_parallel_forks_follow_their_first_choice_and_prompts_spread(
    make_client: ClientFactory,
) -> None:
    """Review: every choice and every prompt went to the first choice's rank: 429 within the
    documented bound (slots + --max-waiting per rank, times ranks) and an idle rank."""
    async with make_client(data_parallel_size=2, num_slots=2, max_waiting=1) as client:
        for n in (3, 4, 6):
            r = await client.post("/v1/completions", json={"prompt": "hi", "n": n,
                                                           "max_tokens": 3})  # fmt: skip
            assert r.status_code == 200 and len(r.json()["choices"]) == n
        r = await client.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"],
                                                       "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


async def test_a_cancel_after_the_first_choice_ended_still_ends_the_others(
    make_client: ClientFactory,
) -> None:
    """Review: once choice 0 had ended, DELETE /requests/<id> answered 404 and left <id>~k
    running."""
    async with make_client(mock_step_ms=1.0) as client:
        serving = serving_of(client)
        params = GenerationParams(prompt=[1, 2, 3], max_tokens=8000, ignore_eos=True)
        first = serving.submit(dataclasses.replace(params, request_id="x"))
        other = serving.submit(dataclasses.replace(params, request_id="x~1"))
        serving.abort("x")  # choice 0 ends alone (as a stop or its max_tokens would)
        await first.ended()
        assert (await client.delete("/requests/x")).status_code == 200
        await other.ended()
        assert other.seq.finish_reason is FinishReason.ABORT
        assert (await client.delete("/requests/x")).status_code == 404
