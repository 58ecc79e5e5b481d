"""LoRA adapters, simulated for the mocks (``--enable-lora``): vLLM's load/unload routes and
answers, a request's ``model`` naming an adapter, ``/v1/models`` with ``parent``,
``vllm:lora_requests_info``, and the scheduler's rule (a batch runs at most ``--max-loras``
distinct adapters; the others wait), held in every step of a stateful test."""

from __future__ import annotations

import asyncio
import functools
import tempfile
from pathlib import Path

import pytest
from conftest import ClientFactory, serving_of
from error_shape import field_of
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lora_adapter import adapter_dir
from prometheus_client.parser import text_string_to_metric_families

from app.cli import check_real_model, parse
from app.config import Settings
from app.engine.policies import PolicyConfig, PolicyName
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step import ModelOutput
from app.engine.step_clock import StepClock, StepCosts, StepWork
from app.engine.types import RequestStatus, Sequence
from app.lora import LoRAError
from app.serving import GenerationParams, Serving, engine_config

ADAPTERS = ("a", "b", "c", "d")
NEVER = 999


# --- the scheduler's rule ---------------------------------------------------------------------


class MaxLorasMachine(RuleBasedStateMachine):
    """Requests with random adapters arrive, run, finish and are aborted; every step keeps the
    rule, and a free slot is left empty only when every waiting request needs a new adapter."""

    @initialize(
        max_loras=st.integers(1, 3),
        slots=st.integers(1, 5),
        budget=st.sampled_from([None, 8]),
        policy=st.sampled_from(["fcfs", "mlfq", "priority"]),
    )
    def start(self, max_loras: int, slots: int, budget: int | None, policy: str) -> None:
        self.max_loras = max_loras
        self.budget = budget
        self.scheduler = Scheduler(
            SchedulerConfig(
                slots,
                max_num_batched_tokens=None if budget is None else max(budget, slots),
                max_loras=max_loras,
                policy=PolicyConfig(PolicyName(policy), mlfq_quantum=1),
            )
        )
        self.live: list[Sequence] = []
        self.n = 0
        self.now = 0.0

    @rule(lora=st.sampled_from((None, *ADAPTERS)), prompt=st.integers(1, 12),
          out=st.integers(1, 6), priority=st.integers(-2, 2))  # fmt: skip
    def arrive(self, lora: str | None, prompt: int, out: int, priority: int) -> None:
        self.n += 1
        seq = Sequence(f"r{self.n}", [5] * prompt, out, frozenset({NEVER}), lora=lora,
                       priority=priority)  # fmt: skip
        self.scheduler.add(seq, self.now)
        self.live.append(seq)

    @precondition(lambda self: any(s.status is not RequestStatus.FINISHED for s in self.live))
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        alive = [s for s in self.live if s.status is not RequestStatus.FINISHED]
        self.scheduler.abort(alive[pick % len(alive)].request_id, self.now)

    @rule()
    def step(self) -> None:
        self.now += 1.0
        scheduler = self.scheduler
        out = scheduler.schedule(self.now)
        stepped = {s.lora for s in (*out.decode_seqs, *out.prefill_seqs) if s.lora is not None}
        assert len(stepped) <= self.max_loras
        admitted = {s.lora for s in (*out.admitted, *out.resumed) if s.lora is not None}
        assert 0 <= out.lora_loads <= len(admitted)
        running = {s.lora for s in scheduler.slots.running() if s.lora is not None}
        if self.budget is None and scheduler.slots.num_free:  # work conserving, but the rule
            for seq in scheduler.waiting:
                assert seq.lora is not None and seq.lora not in running
                assert len(running) == self.max_loras
        if not out.empty:
            scheduler.update(out, ModelOutput([7] * out.num_outputs), self.now)

    @invariant()
    def running_adapters_within_max_loras(self) -> None:
        if hasattr(self, "scheduler"):
            running = {s.lora for s in self.scheduler.slots.running() if s.lora is not None}
            assert len(running) <= self.max_loras

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(1000):  # everyone finishes: no adapter starves
            if not self.scheduler.has_work():
                break
            self.step()
        assert all(s.status is RequestStatus.FINISHED for s in self.live)


TestMaxLoras = MaxLorasMachine.TestCase
TestMaxLoras.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def test_an_adapter_load_is_counted_once_while_it_holds_an_adapter_slot() -> None:
    scheduler = Scheduler(SchedulerConfig(1, max_loras=2))
    loads = []
    for i, lora in enumerate(("a", "b", "a", "c", "a", "b")):
        seq = Sequence(f"r{i}", [5, 5], 1, frozenset({NEVER}), lora=lora)
        scheduler.add(seq, 0.0)
        out = scheduler.schedule(0.0)
        loads.append(out.lora_loads)
        scheduler.update(out, ModelOutput([7]), 0.0)
    # two adapter slots, least recently admitted replaced: a b | a | c(replaces b) | a | b
    assert loads == [1, 1, 0, 1, 0, 1]


def _priority_scheduler(slots: int) -> Scheduler:
    return Scheduler(SchedulerConfig(slots, max_loras=1,
                                     policy=PolicyConfig(PolicyName.PRIORITY)))  # fmt: skip


def _run_until_done(scheduler: Scheduler, now: float = 1.0) -> None:
    for _ in range(200):
        if not scheduler.has_work():
            return
        out = scheduler.schedule(now)
        if not out.empty:
            scheduler.update(out, ModelOutput([7] * out.num_outputs), now)
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("policy", ["priority", "mlfq"])
def test_a_policy_does_not_preempt_for_an_adapter_that_cannot_join(policy: str) -> None:
    """Review finding 3: --max-loras 1, two adapter-A requests hold both slots, a better
    adapter-B request arrives: preempting an A request would free a slot B still cannot take
    (A keeps running), so nothing is preempted and B runs once A has drained."""
    scheduler = Scheduler(SchedulerConfig(2, max_loras=1, policy=PolicyConfig(
        PolicyName(policy), mlfq_quantum=1)))  # fmt: skip
    running = [Sequence(f"a{i}", [5] * 4, 30, frozenset({NEVER}), lora="A", priority=5)
               for i in range(2)]  # fmt: skip
    for seq in running:
        scheduler.add(seq, 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update(out, ModelOutput([7] * out.num_outputs), 0.0)
    late = Sequence("b", [5] * 40, 2, frozenset({NEVER}), lora="B", priority=0)
    scheduler.add(late, 0.0)
    _run_until_done(scheduler)
    assert [s.num_preemptions for s in running] == [0, 0]
    assert late.status is RequestStatus.FINISHED


def test_the_lora_fallback_admits_in_the_policys_order() -> None:
    """Review finding 4: the policy's pick (adapter B) cannot join a batch running A; among the
    A requests that can, the better priority is admitted first, not the earlier arrival."""
    scheduler = _priority_scheduler(2)
    first = Sequence("a0", [5] * 4, 50, frozenset({NEVER}), lora="A", priority=0)
    scheduler.add(first, 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update(out, ModelOutput([7] * out.num_outputs), 0.0)
    late = [Sequence("b", [5] * 4, 2, frozenset({NEVER}), lora="B", priority=0),
            Sequence("a1-prio10", [5] * 4, 2, frozenset({NEVER}), lora="A", priority=10),
            Sequence("a2-prio1", [5] * 4, 2, frozenset({NEVER}), lora="A", priority=1)]  # fmt: skip
    for seq in late:
        scheduler.add(seq, 0.0)
    out = scheduler.schedule(1.0)
    assert [s.request_id for s in out.admitted] == ["a2-prio1"]


# --- the registry, against a plain reference --------------------------------------------------


@functools.cache
def _adapter_folder() -> str:
    """One adapter folder for every example of the machine below (made once a session)."""
    return str(adapter_dir(Path(tempfile.mkdtemp(prefix="slotserve-lora-"))))


class RegistryMachine(RuleBasedStateMachine):
    """Loads, unloads and requests per adapter through ``Serving`` against a dict: every answer
    (added, duplicate, missing path, past --max-cpu-loras, unknown) is the reference's."""

    def __init__(self) -> None:
        super().__init__()
        self.serving = Serving(Settings(enable_lora=True, max_loras=1, max_cpu_loras=3))
        self.reference: dict[str, str] = {}
        self.existing = _adapter_folder()

    @rule(name=st.sampled_from(ADAPTERS), exists=st.booleans())
    def load(self, name: str, exists: bool) -> None:
        path = self.existing if exists else "/no/such/adapter"
        expected = (
            "duplicate" if name in self.reference
            else "not_loadable" if not exists
            else "too_many" if len(self.reference) >= 3
            else None
        )  # fmt: skip
        try:
            self.serving.loras.load(name, path)
        except LoRAError as err:
            assert err.kind == expected
        else:
            assert expected is None
            self.reference[name] = path

    @rule(name=st.sampled_from(ADAPTERS))
    def unload(self, name: str) -> None:
        try:
            self.serving.loras.unload(name)
        except LoRAError as err:
            assert err.kind == "not_found" and name not in self.reference
        else:
            del self.reference[name]

    @rule(model=st.sampled_from((None, "slotserve-mock", *ADAPTERS)))
    def request(self, model: str | None) -> None:
        try:
            adapter = self.serving.adapter(model)
        except LookupError:
            assert model not in self.reference and model not in (None, "slotserve-mock")
        else:
            assert adapter == (model if model in self.reference else None)
            if adapter is not None:
                seq = self.serving.prepare(GenerationParams(prompt=[5, 6], lora=adapter))
                assert seq.lora == adapter

    @invariant()
    def same_adapters(self) -> None:
        assert {n: a.path for n, a in self.serving.loras.adapters.items()} == self.reference


TestRegistry = RegistryMachine.TestCase
TestRegistry.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# --- over HTTP --------------------------------------------------------------------------------


async def test_load_unload_and_serve_adapters_over_http(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    adapter_dir(tmp_path / "sql")
    adapter_dir(tmp_path)
    async with make_client(enable_lora=True, max_loras=1, max_cpu_loras=2,
                           lora_modules=[f"sql={tmp_path / 'sql'}"]) as client:  # fmt: skip
        models = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            ("slotserve-mock", None), ("sql", "slotserve-mock")]  # fmt: skip
        load = {"lora_name": "chat", "lora_path": str(tmp_path)}
        answer = await client.post("/v1/load_lora_adapter", json=load)
        assert answer.status_code == 200
        assert answer.text == "Success: LoRA adapter 'chat' added successfully."
        again = await client.post("/v1/load_lora_adapter", json=load)
        assert again.status_code == 400
        assert (
            again.json()["error"]["message"] == "The lora adapter 'chat' has already been loaded."
        )
        third = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "x", "lora_path": str(tmp_path)})  # fmt: skip
        assert (
            third.status_code == 400 and third.headers["x-slotserve-error-code"] == "too_many_loras"
        )
        missing = await client.post("/v1/load_lora_adapter",
                                    json={"lora_name": "y", "lora_path": "/no/such"})  # fmt: skip
        assert missing.status_code == 400 and field_of(missing.json()["error"]) == "lora_path"
        bad = await client.post("/v1/load_lora_adapter", json={"lora_name": "z"})
        assert bad.status_code == 400 and field_of(bad.json()["error"]) == "lora_path"

        body = {"model": "chat", "prompt": "Hello ", "max_tokens": 3}
        done = await client.post("/v1/completions", json=body)
        assert done.status_code == 200 and done.json()["model"] == "chat"
        unknown = await client.post("/v1/completions", json={**body, "model": "nope"})
        assert (
            unknown.status_code == 404
            and unknown.headers["x-slotserve-error-code"] == "model_not_found"
        )

        # unloading an adapter a request still uses: 200; the request finishes; new ones 404
        serving = serving_of(client)
        stream = serving.submit(GenerationParams(prompt=[72, 105], max_tokens=50,
                                                 ignore_eos=True, lora="chat"))  # fmt: skip
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert gone.status_code == 200
        assert gone.text == "Success: LoRA adapter 'chat' removed successfully."
        tokens, reason, _ = await stream.collect()
        assert len(tokens) == 50 and reason is not None and reason.value == "length"
        after = await client.post("/v1/completions", json=body)
        assert after.status_code == 404
        twice = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert twice.status_code == 404
        assert twice.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."


async def test_lora_requests_info_names_running_and_waiting_adapters(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    modules = [f"{name}={adapter_dir(tmp_path)}" for name in ("a", "b")]
    async with make_client(enable_lora=True, max_loras=1, max_cpu_loras=2, num_slots=4,
                           max_num_batched_tokens=4, lora_modules=modules,
                           mock_step_ms=1.0) as client:  # fmt: skip
        serving = serving_of(client)
        streams = [serving.submit(GenerationParams(prompt=[72, 105], max_tokens=200,
                                                   ignore_eos=True, lora=lora))
                   for lora in ("a", "b")]  # fmt: skip
        text = ""
        for _ in range(200):  # until the first request runs (a step boundary away)
            text = (await client.get("/metrics")).text
            if 'running_lora_adapters="a"' in text:
                break
            await asyncio.sleep(0.005)
        family = next(f for f in text_string_to_metric_families(text)
                      if f.name == "vllm:lora_requests_info")  # fmt: skip
        (sample,) = family.samples
        assert sample.labels == {"max_lora": "1", "running_lora_adapters": "a",
                                 "waiting_lora_adapters": "b"}  # fmt: skip
        assert sample.value > 1e9  # a timestamp, as vLLM sets it
        for stream in streams:
            serving.abort(stream.request_id)


def test_lora_flags_are_checked_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter_dir(tmp_path)
    _, parsed = parse(["serve", "--enable-lora", "--max-cpu-loras", "2", "--lora-modules",
                       f"a={tmp_path}", f"b={tmp_path}"])  # fmt: skip
    assert parsed.lora_modules == [f"a={tmp_path}", f"b={tmp_path}"]
    for argv in (["--lora-modules", "a=/x"],  # without --enable-lora
                 ["--enable-lora", "--lora-modules", "nameonly"],
                 ["--enable-lora", "--lora-modules", "a=/x", "a=/y"],
                 ["--enable-lora", "--lora-modules", "a=/x", "b=/y"],  # past --max-cpu-loras 1
                 ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse(["serve", *argv])
        assert "--" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(LoRAError, match="--lora-modules a=/no/such: no LoRA adapter loads"):
        Serving(Settings(enable_lora=True, lora_modules=["a=/no/such"]))
    with pytest.raises(SystemExit):
        check_real_model(Settings(model="hf:/nowhere", enable_lora=True))
    assert capsys.readouterr().err.strip() == (
        "slotserve: error: --enable-lora: LoRA adapters are simulated for the mocks only; a real "
        "model has no LoRA weights path"
    )


def test_the_openai_client_names_an_adapter_on_a_real_server(tmp_path: Path) -> None:
    from openai import NotFoundError, OpenAI
    from server_process import running_server

    adapter_dir(tmp_path)
    with running_server("--enable-lora", "--lora-modules", f"sql={tmp_path}") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        models = {m.id: m for m in client.models.list()}
        assert models["sql"].model_extra == {"root": "sql", "parent": "slotserve-mock"}
        reply = client.completions.create(model="sql", prompt="Once ", max_tokens=4)
        assert reply.model == "sql" and reply.choices[0].text
        chat = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        assert {chunk.model for chunk in chat} == {"sql"}
        with pytest.raises(NotFoundError):
            client.completions.create(model="nope", prompt="Once ", max_tokens=4)


def test_the_step_clock_charges_adapter_loads() -> None:
    clock = StepClock(StepCosts(step_ms=1.0, lora_load_ms=5.0))
    assert clock.duration(StepWork.counts(0, 4, lora_loads=2)) == pytest.approx(0.011)
    assert clock.paced_deadline(10.0, StepWork.counts(0, 4, lora_loads=1), None) == pytest.approx(
        10.006
    )
    assert StepCosts(lora_load_ms=5.0).enabled
    settings = Settings(enable_lora=True, lora_switch_ms=7.0)
    loads = StepWork.counts(0, 0, lora_loads=1)
    assert engine_config(settings).step_costs.seconds(loads) == pytest.approx(0.007)
    assert engine_config(Settings(lora_switch_ms=7.0)).step_costs.seconds(loads) == 0.0
