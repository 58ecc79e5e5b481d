"""The Kubernetes manifests in docker/k8s/ checked against the Kubernetes API's OpenAPI schemas,
offline, with ``kubernetes-validate`` (which ships the schemas of every Kubernetes release it
supports), in strict mode (an unknown field is an error, as with ``kubectl apply
--validate=strict``).

They are checked for the oldest Kubernetes version docs/scaling.md says the manifests support,
and for the newest one the package knows. Custom resources (InferencePool, Gateway, HTTPRoute,
PodMonitor) have no schema there; docs/scaling.md says how far they are checked.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from deploy_files import DOCKER, REPO

K8S = DOCKER / "k8s"
# Objects of these kinds are not Kubernetes API objects with a schema in kubernetes-validate.
CUSTOM_KINDS = {"InferencePool", "Gateway", "HTTPRoute", "PodMonitor"}
NOT_API_OBJECTS = {"kustomization.yaml", "prometheus-adapter-values.yaml"}  # kustomize, helm


def oldest_supported_version() -> str:
    """The version in docs/scaling.md's claim "Kubernetes 1.NN or newer"."""
    text = (REPO / "docs/scaling.md").read_text(encoding="utf-8")
    (version,) = set(re.findall(r"Kubernetes (\d+\.\d+) or newer", text))
    return str(version)


def newest_known_version() -> str:
    major, minor, *_ = kubernetes_validate.latest_version().split(".")
    return f"{major}.{minor}"


VERSIONS = [oldest_supported_version(), newest_known_version()]


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) for every object in docker/k8s/ that is applied to a cluster."""
    objects = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in NOT_API_OBJECTS:
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                objects.append((path.name, doc))
    return objects


def validate(obj: dict[str, Any], version: str) -> str:
    """The Kubernetes version whose schema accepted ``obj``; raises on a violation."""
    validated: str = kubernetes_validate.validate(obj, version, strict=True)
    return validated


@pytest.mark.parametrize("version", VERSIONS)
def test_k8s_manifests_match_the_kubernetes_api_schemas(version: str) -> None:
    checked = set()
    for name, obj in manifests():
        where = f"{name}: {obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            assert validate(obj, version) == version, where
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(part) for part in err.path)
            pytest.fail(f"{where} against Kubernetes {version}: {path}: {err.message}")
        checked.add(obj["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= checked


def test_k8s_schema_check_rejects_what_the_api_server_would() -> None:
    """The check is live: a wrong type, an unknown field and a removed API version fail."""
    version = VERSIONS[0]
    deployment = next(obj for _, obj in manifests() if obj["kind"] == "Deployment")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "80"
    unknown_field = copy.deepcopy(deployment)
    unknown_field["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["path"] = "/"
    for broken in (wrong_type, unknown_field):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken, version)
    hpa = next(obj for _, obj in manifests() if obj["kind"] == "HorizontalPodAutoscaler")
    removed = copy.deepcopy(hpa) | {"apiVersion": "autoscaling/v2beta2"}  # gone in 1.26
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(removed, version)


def test_k8s_custom_resources_are_the_documented_ones() -> None:
    """docs/scaling.md names each custom resource kind that the schema check leaves out."""
    kinds = {obj["kind"] for _, obj in manifests()} & CUSTOM_KINDS
    assert kinds == CUSTOM_KINDS
    docs = (REPO / "docs/scaling.md").read_text(encoding="utf-8")
    for kind in CUSTOM_KINDS:
        assert f"`{kind}`" in docs, f"docs/scaling.md does not say how {kind} is checked"


def test_k8s_manifest_files_are_all_covered() -> None:
    files = {path.name for path in K8S.glob("*.yaml")}
    covered = {name for name, _ in manifests()} | NOT_API_OBJECTS
    assert files == covered, "a new file in docker/k8s/: validate it or list it here"
