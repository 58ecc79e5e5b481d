"""The real vLLM router (PyPI ``vllm-router``, a test extra) as a process on 127.0.0.1.

``VllmRouter`` starts ``vllm-router`` in front of worker URLs with a policy and extra flags,
waits until its ``/readiness`` answers 200, and reads its log (INFO, colours stripped): a
router's routing decisions are visible nowhere else. The router polls ``/get_load`` every
``--worker-startup-check-interval`` seconds under ``power_of_two`` (its load monitor reuses that
interval), so the tests set it to 1 s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_process import free_port

ROUTER_BIN = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
    "vllm-router"
)
STARTUP_TIMEOUT = 30.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class VllmRouter:
    """One ``vllm-router`` process (see the module's docstring)."""

    def __init__(self, workdir: Path, policy: str, workers: list[str], *flags: str) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = workdir / f"vllm-router-{policy}.log"
        assert ROUTER_BIN is not None
        self.command = [
            ROUTER_BIN, "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-port", str(self.metrics_port), "--policy", policy,
            *(["--worker-urls", *workers] if workers else []),  # (none: P/D names them)
            "--worker-startup-check-interval", "1",
            "--log-level", "debug" if policy == "kv_aware" else "info", *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        with httpx.Client(timeout=1.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"vllm-router exited:\n{self.log()[-3000:]}")
                try:
                    if http.get(self.url + "/readiness").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)  # another process binding: there is no event to await
        raise AssertionError(f"vllm-router not ready in {STARTUP_TIMEOUT} s:\n{self.log()[-3000:]}")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the router's own Prometheus samples called ``name`` with ``labels``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = httpx.get(url, timeout=5.0, trust_env=False).raise_for_status().text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def log(self) -> str:
        return ANSI.sub("", self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@contextmanager
def running_router(
    workdir: Path, policy: str, workers: list[str], *flags: str
) -> Iterator[VllmRouter]:
    router = VllmRouter(workdir, policy, workers, *flags)
    try:
        router.start()
        yield router
    finally:
        router.stop()
