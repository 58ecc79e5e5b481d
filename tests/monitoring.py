"""A real Prometheus on 127.0.0.1 for the monitoring tests, and the Grafana dashboard's queries.

``running_prometheus`` starts Debian's ``prometheus`` with the shipped ``docker/prometheus.yml``,
in which only the targets (and, for a fast test, the scrape and evaluation intervals) are
rewritten. ``dashboard_queries`` reads every PromQL expression of a Grafana dashboard JSON, and
``DashboardVariables`` fills in its variables the way Grafana does for a Prometheus datasource.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from deploy_files import DOCKER
from server_process import free_port, wait_until

T = TypeVar("T")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
PROMETHEUS_CONFIG = DOCKER / "prometheus.yml"
DASHBOARDS = DOCKER / "grafana" / "dashboards"
SD_CONFIGS = re.compile(r"^\w+_sd_configs$")


def config_for_test(targets: dict[str, list[str]], interval: str) -> dict[str, Any]:
    """The shipped configuration with each job's service discovery replaced by the static
    ``targets`` given for it, and every scrape and evaluation interval set to ``interval``."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), f"give targets for the shipped jobs {sorted(jobs)}"
    for name, job in jobs.items():
        for key in [key for key in job if SD_CONFIGS.match(key) or key == "static_configs"]:
            del job[key]
        job["static_configs"] = [{"targets": targets[name]}]
        job.pop("scrape_interval", None)
    return config


@dataclass
class Prometheus:
    """A running Prometheus and its HTTP API."""

    url: str
    http: httpx.Client

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; fails on an error answer."""
        answer = self.http.get(f"{self.url}/api/v1/{path}", params=params).json()
        assert answer["status"] == "success", f"{path} {params}: {answer}"
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as a one-sample list) ``expr`` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self, job: str) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return [target for target in active if target["labels"]["job"] == job]


@contextmanager
def running_prometheus(
    workdir: Path, targets: dict[str, list[str]], interval: str = "1s"
) -> Iterator[Prometheus]:
    """Start Prometheus on a free 127.0.0.1 port with the shipped configuration (see
    ``config_for_test``; ``targets`` may name the job ``prometheus`` with the placeholder
    ``"self"`` for Prometheus's own address) and its rule files; wait until it is ready."""
    assert PROMETHEUS is not None
    port = free_port()
    address = f"127.0.0.1:{port}"
    targets = {job: [address if t == "self" else t for t in ts] for job, ts in targets.items()}
    config = config_for_test(targets, interval)
    for rule_file in config.get("rule_files", []):
        shutil.copy(PROMETHEUS_CONFIG.parent / rule_file, workdir / rule_file)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    log_path = workdir / "prometheus.log"
    command = [PROMETHEUS, f"--config.file={config_path}", f"--web.listen-address={address}",
               f"--storage.tsdb.path={workdir / 'data'}", "--log.level=warn"]  # fmt: skip
    with log_path.open("wb") as log, httpx.Client(timeout=10, trust_env=False) as http:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        prometheus = Prometheus(f"http://{address}", http)
        try:
            wait_until(lambda: _ready(prometheus, process, log_path), 30, "Prometheus ready")
            yield prometheus
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _ready(prometheus: Prometheus, process: subprocess.Popen[bytes], log_path: Path) -> bool:
    if process.poll() is not None:
        log = log_path.read_text(encoding="utf-8", errors="replace")
        raise AssertionError(f"prometheus exited with {process.returncode}:\n{log}")
    try:
        return prometheus.http.get(prometheus.url + "/-/ready").status_code == 200
    except httpx.TransportError:
        return False


# --- Grafana dashboards -------------------------------------------------------------------


def load_dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard, for every dashboard JSON shipped."""
    paths = sorted(DASHBOARDS.glob("*.json"))
    assert paths, f"no dashboard in {DASHBOARDS}"
    return {path.name: json.loads(path.read_text(encoding="utf-8")) for path in paths}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    stack = list(reversed(dashboard.get("panels", [])))
    while stack:
        panel = stack.pop()
        yield panel
        stack.extend(reversed(panel.get("panels", [])))


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"panel {self.panel!r} query {self.ref}: {self.expr}"


def dashboard_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Every PromQL expression of every panel (rows have none; every other panel has one)."""
    queries = []
    for panel in panels(dashboard):
        if panel.get("type") == "row":
            continue
        exprs = [target for target in panel.get("targets", []) if target.get("expr")]
        assert exprs, f"panel {panel.get('title')!r} has no PromQL query to check"
        for index, target in enumerate(exprs):
            ref = target.get("refId", str(index))
            queries.append(PanelQuery(panel.get("title", "?"), ref, target["expr"]))
    return queries


LABEL_VALUES = re.compile(r"^label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)$")
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))|\[\[(\w+)\]\]")


def promql_regex_value(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into a Prometheus query: each value
    regex-escaped (the backslashes doubled for the PromQL string), several as ``(a|b)``."""
    escaped = [re.escape(value).replace("\\", "\\\\") for value in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


class DashboardVariables:
    """A dashboard's template variables, resolved against a live Prometheus.

    Each ``query`` variable (``label_values(selector, label)``) is evaluated in order, so a
    variable may use the ones before it, and every value it finds is selected; built-in
    variables get the values Grafana would give them for ``scrape_interval``."""

    def __init__(self, dashboard: dict[str, Any], scrape_seconds: float) -> None:
        self.definitions = dashboard.get("templating", {}).get("list", [])
        self.values: dict[str, str] = {
            "__rate_interval": f"{4 * scrape_seconds:g}s",  # Grafana: max(4 x scrape, ...)
            "__interval": f"{scrape_seconds:g}s",
            "__range": "5m",
        }
        self.found: dict[str, list[str]] = {}

    def resolve(self, prometheus: Prometheus) -> dict[str, list[str]]:
        """Variable name -> the values its query found (every query variable)."""
        for variable in self.definitions:
            kind, name = variable["type"], variable["name"]
            if kind == "datasource":
                continue  # names the datasource, never appears in an expression
            assert kind == "query", f"variable {name}: teach the test about {kind} variables"
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            match = LABEL_VALUES.match(self.fill(text))
            assert match, f"variable {name}: teach the test about the query {text!r}"
            values = self.label_values(prometheus, match["selector"], match["label"])
            self.found[name] = values
            if values:
                self.values[name] = promql_regex_value(values)
        return self.found

    @staticmethod
    def label_values(prometheus: Prometheus, selector: str | None, label: str) -> list[str]:
        params = {"match[]": selector} if selector else {}
        values: list[str] = prometheus.api(f"label/{label}/values", **params)
        return sorted(values)

    def fill(self, expr: str) -> str:
        """``expr`` with every variable replaced; an unknown one fails the test."""

        def value(match: re.Match[str]) -> str:
            name = next(group for group in match.groups() if group)
            assert name in self.values, f"no value for the dashboard variable ${name} in {expr}"
            return self.values[name]

        return VARIABLE.sub(value, expr)


def finite_samples(result: list[dict[str, Any]]) -> list[float]:
    """The finite values of an instant query's samples (NaN, as from a quantile of an empty
    histogram, and infinities are what a panel would not chart)."""
    values = [float(sample["value"][1]) for sample in result]
    return [value for value in values if math.isfinite(value)]
