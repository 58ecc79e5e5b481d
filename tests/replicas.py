"""Real slotserve replicas for the tests that put a front end before several of them (nginx,
the vLLM router): each a ``python -m app serve`` process on a free 127.0.0.1 port, logging to a
file, with its metrics read back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from deploy_files import REPO
from prometheus_client.parser import text_string_to_metric_families
from server_process import free_port


def client(timeout: float = 10.0) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)  # never through an HTTP proxy


class Replica:
    """One ``python -m app serve`` process on a free 127.0.0.1 port."""

    def __init__(self, workdir: Path, name: str, *flags: str) -> None:
        self.name, self.flags = name, flags
        self.log_path = workdir / f"{name}.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTSERVE_")}
        command = [sys.executable, "-m", "app", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--log-level", "warning", *self.flags]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_healthy(self, timeout: float = 20.0) -> bool:
        """True once /health answers 200; False if the process exited (e.g. port taken)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with client(timeout=1.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"replica {self.name} not healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def slots(self) -> dict[str, Any]:
        with client() as http:
            answer: dict[str, Any] = http.get(self.url + "/slots").raise_for_status().json()
            return answer

    def running_ids(self) -> set[str]:
        return {s["request_id"] for s in self.slots()["slots"] if s["is_processing"]}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        with client() as http:
            text = http.get(self.url + "/metrics").raise_for_status().text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    def successes(self) -> float:
        return self.metric("vllm:request_success_total")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGTERM):  # the second SIGTERM skips the drain
            proc.send_signal(sig)
            try:
                proc.wait(timeout=3)
                return
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait(timeout=5)


def start_replicas(stack: ExitStack, workdir: Path, *replicas: Replica) -> None:
    """Start the replicas in parallel; a replica that lost its port race is started again."""
    for replica in replicas:
        stack.callback(replica.stop)
    pending = list(replicas)
    for _ in range(3):
        for replica in pending:
            replica.spawn()
        pending = [replica for replica in pending if not replica.wait_healthy()]
        if not pending:
            return
    raise AssertionError(f"replica {pending[0].name} did not start:\n{pending[0].log()}")
