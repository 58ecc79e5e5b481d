"""Monitoring proved with the real tools: ``promtool`` on the shipped Prometheus configuration
and alerting rules, and a real Prometheus scraping two real server replicas under load, against
which every query of every shipped Grafana dashboard and every alerting rule is evaluated.

Debian's ``prometheus`` package provides both binaries (``.ci/run`` installs it); without them
these tests are skipped. Select them with ``pytest -k monitoring``.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import ClientFactory
from deploy_files import DOCKER
from monitoring import (
    PROMETHEUS,
    PROMETHEUS_CONFIG,
    PROMTOOL,
    DashboardVariables,
    PanelQuery,
    Prometheus,
    dashboard_queries,
    finite_samples,
    load_dashboards,
    running_prometheus,
)
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, running_server, wait_until

from app.engine.types import FinishReason
from app.metrics import REJECT_REASONS
from app.serving import REJECTION_REASONS

pytestmark = pytest.mark.monitoring
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool (.ci/run installs Debian's prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus (.ci/run installs Debian's prometheus)"
)
ALERTS = DOCKER / "prometheus-alerts.yml"
ALERT_TESTS = DOCKER / "prometheus-alerts.test.yml"
SCRAPE_SECONDS = 1.0
# A selector in a rule: a metric name with optional label matchers, then a range or not.
SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?(?=\s*\[)|([a-zA-Z_:][\w:]*)(\{[^}]*\})")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def run(*command: str) -> str:
    """Run a tool in docker/ (where relative rule paths point); fail with its output."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=DOCKER)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


# --- promtool -----------------------------------------------------------------------------


@needs_promtool
def test_monitoring_promtool_accepts_the_shipped_config_and_its_rules() -> None:
    assert PROMTOOL is not None
    rule_files = load_yaml(PROMETHEUS_CONFIG)["rule_files"]
    assert rule_files == [ALERTS.name]
    output = run(PROMTOOL, "check", "config", str(PROMETHEUS_CONFIG))
    assert f"{len(rule_files)} rule files found" in output, output
    run(PROMTOOL, "check", "rules", str(ALERTS))


@needs_promtool
def test_monitoring_every_alert_fires_on_its_failure_and_only_there() -> None:
    """``promtool test rules``: each alert fires for the bad replica after its ``for`` time,
    and not for the healthy one (docker/prometheus-alerts.test.yml)."""
    assert PROMTOOL is not None
    alerts = {rule["alert"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]}
    tested = {
        case["alertname"]
        for test in load_yaml(ALERT_TESTS)["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == tested, f"alerts without a firing test: {alerts - tested}"
    assert "SUCCESS" in run(PROMTOOL, "test", "rules", str(ALERT_TESTS))


# --- labelled counters exist from the start -----------------------------------------------


async def test_monitoring_labelled_counters_are_exported_at_zero_before_any_request(
    make_client: ClientFactory,
) -> None:
    async with make_client(model_name="m") as client:
        text = (await client.get("/metrics")).text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    expected = [  # key="": no named API keys (a named key's series start with its first use)
        ("vllm:request_success_total", {"finished_reason": reason.value, "key": ""})
        for reason in FinishReason
    ]
    expected += [
        ("slotserve:requests_rejected_total", {"reason": r, "key": ""}) for r in REJECT_REASONS
    ]
    expected += [("slotserve:model_call_failures_total", {})]
    expected += [(f"{name}_count", {}) for name in (
        "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:inter_token_latency_seconds",
    )]  # fmt: skip
    for name, labels in expected:
        key = (name, tuple(sorted({"engine": "0", "model_name": "m", **labels}.items())))
        assert samples.get(key) == 0.0, f"{name}{labels} is not exported at 0"


def test_monitoring_every_reject_reason_in_the_code_is_exported_at_zero() -> None:
    """A new refusal reason must join REJECT_REASONS, or its series would appear only with
    its first refusal."""
    used = {*REJECTION_REASONS.values(), "engine_dead"}  # serving's labels, and its fallback
    assert used <= set(REJECT_REASONS), used - set(REJECT_REASONS)


# --- a live Prometheus scraping two replicas ----------------------------------------------


class Traffic:
    """Background clients sending short generations to every replica until stopped."""

    def __init__(self, urls: list[str], clients: int = 4) -> None:
        self.urls, self.stopping = urls, threading.Event()
        self.sent = [0] * len(urls)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.loop, args=(i,)) for i in range(clients)]

    def loop(self, worker: int) -> None:
        body = {"prompt": "Tell me about slots ", "max_tokens": 24, "stream": False}
        with httpx.Client(timeout=10, trust_env=False) as http:
            turn = worker
            while not self.stopping.is_set():
                index = turn % len(self.urls)
                try:
                    response = http.post(self.urls[index] + "/generate", json=body)
                except httpx.HTTPError as err:
                    self.errors.append(repr(err))
                    return
                if response.status_code != 200:
                    self.errors.append(response.text)
                self.sent[index] += 1
                turn += 1

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        for thread in self.threads:
            thread.start()
        try:
            yield self
        finally:
            self.stopping.set()
            for thread in self.threads:
                thread.join(timeout=15)


def both_scraped(prometheus: Prometheus, replicas: list[ServerProcess]) -> bool:
    """Both replicas are targets of the ``slotserve`` job, up, and already scraped."""
    targets = prometheus.targets("slotserve")
    up = {t["labels"]["instance"] for t in targets if t["health"] == "up" and t["lastScrape"]}
    return up == {f"127.0.0.1:{replica.port}" for replica in replicas}


def unanswered(prometheus: Prometheus, queries: list[tuple[PanelQuery, str]]) -> list[str]:
    """The queries that return no sample with a finite value, with what they returned."""
    failing = []
    for query, expr in queries:
        result = prometheus.query(expr)
        if not finite_samples(result):
            failing.append(f"{query}\n    as sent: {expr}\n    result: {result}")
    return failing


def rule_selectors(expr: str) -> list[str]:
    """The vector selectors of a rule expression (metric name and label matchers)."""
    return [(m[1] or m[3]) + (m[2] or m[4] or "") for m in SELECTOR.finditer(expr)]


@needs_prometheus
def test_monitoring_prometheus_scrapes_two_replicas_and_every_dashboard_query_answers(
    tmp_path: Path,
) -> None:
    with ExitStack() as stack:
        flags = ("--model", "mock", "--mock-step-ms", "5", "--num-slots", "4")
        replicas = [stack.enter_context(running_server(*flags)) for _ in range(2)]
        targets = {
            "slotserve": [f"127.0.0.1:{replica.port}" for replica in replicas],
            "prometheus": ["self"],
        }
        interval = f"{SCRAPE_SECONDS:g}s"
        prometheus = stack.enter_context(running_prometheus(tmp_path, targets, interval))
        with Traffic([replica.url for replica in replicas]).running() as traffic:
            wait_until(lambda: both_scraped(prometheus, replicas), 20, "both replicas scraped")
            for name, dashboard in load_dashboards().items():
                check_every_panel_answers(prometheus, name, dashboard, targets["slotserve"])
            check_rules_loaded_and_evaluated(prometheus)
        assert all(traffic.sent) and not traffic.errors, (traffic.sent, traffic.errors[:3])

        # A replica that dies is noticed for real: its ReplicaDown alert becomes pending.
        replicas[1].process.kill()
        dead = f"127.0.0.1:{replicas[1].port}"
        wait_until(lambda: dead in alerted(prometheus, "SlotserveReplicaDown"), 15, "the alert")


def alerted(prometheus: Prometheus, name: str) -> set[str]:
    """The instances for which alert ``name`` is pending or firing."""
    alerts = prometheus.api("alerts")["alerts"]
    return {a["labels"].get("instance", "") for a in alerts if a["labels"]["alertname"] == name}


def check_every_panel_answers(
    prometheus: Prometheus, name: str, dashboard: dict[str, Any], instances: list[str]
) -> None:
    """Each of the dashboard's variables finds values (the model variable the served model,
    the replica variable both replicas), and each of its queries, with the variables filled
    in, returns a finite value."""
    variables = DashboardVariables(dashboard, SCRAPE_SECONDS)
    found = variables.resolve(prometheus)
    assert all(found.values()), f"{name}: a variable finds nothing: {found}"
    expected = {"model": ["slotserve-mock"], "instance": sorted(instances)}
    for variable, values in expected.items():
        assert found.get(variable, values) == values, (name, variable, found)
    queries = [(query, variables.fill(query.expr)) for query in dashboard_queries(dashboard)]
    # Rates need two scrapes with traffic in between: poll until every query answers.
    failing = unanswered(prometheus, queries)
    deadline = time.monotonic() + 30
    while failing and time.monotonic() < deadline:
        time.sleep(0.5)
        failing = unanswered(prometheus, queries)
    assert not failing, f"{name}: panels with no data:\n" + "\n".join(failing)


def check_rules_loaded_and_evaluated(prometheus: Prometheus) -> None:
    """Every shipped rule is loaded and evaluated without error, none fires on healthy
    replicas, and every series it reads exists."""
    shipped = {rule.get("alert") or rule["record"]: rule["expr"]
               for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]}  # fmt: skip

    def evaluated() -> list[dict[str, Any]] | None:
        groups = prometheus.api("rules")["groups"]
        rules: list[dict[str, Any]] = [rule for group in groups for rule in group["rules"]]
        done = all(not rule["lastEvaluation"].startswith("0001") for rule in rules)
        return rules if done and rules else None

    rules = wait_until(evaluated, 10, "every rule evaluated once")
    assert {rule["name"] for rule in rules} == set(shipped)
    for rule in rules:
        assert rule["health"] == "ok", rule
        assert rule.get("state", "inactive") != "firing", rule
        for selector in rule_selectors(shipped[rule["name"]]):
            assert prometheus.query(f"count({selector})"), f"{rule['name']}: no {selector}"
