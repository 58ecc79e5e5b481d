"""The README's commands run as written: each section's ``make serve`` line starts a real server
with the same flags, and the section's shell and Python blocks run against it. The one change
made to a command is the port (the test's free one instead of 8000, and ``--url`` for the
bench) and the interpreter (this test's, for ``.venv/bin/``). ``make test`` and friends are
checked with ``make -n`` (they exist; running them here would run this suite again)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from server_process import LOAD_TIMEOUT, ServerProcess, running_server

REPO = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent) + "/"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Section:
    """A ``##`` section's blocks in order: (language, code)."""

    title: str
    blocks: list[tuple[str, str]] = field(default_factory=list)

    def shell_lines(self) -> list[str]:
        return [line for lang, code in self.blocks if lang == "sh" for line in commands(code)]

    def serve_flags(self) -> list[str] | None:
        """The server a section's ``make serve`` line starts, as ``serve`` flags."""
        for line in self.shell_lines():
            words = shlex.split(line.split("#")[0])
            if words[:2] == ["make", "serve"]:
                flags: list[str] = []
                for word in words[2:]:
                    key, _, value = word.partition("=")
                    if key == "ARGS":
                        flags += shlex.split(value)
                    elif key == "MODEL":
                        flags += ["--model", value]
                return flags
        return None


def commands(code: str) -> list[str]:
    """A shell block's commands, continuation lines joined, comments and blanks dropped."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def sections() -> dict[str, Section]:
    text = (REPO / "README.md").read_text()
    found: dict[str, Section] = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title = part.splitlines()[0]
        found[title] = Section(title, [(m[1], m[2]) for m in FENCE.finditer(part)])
    return found


def local(command: str, server: ServerProcess) -> str:
    """``command`` aimed at ``server``: its port, this interpreter's folder."""
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    command = command.replace(".venv/bin/", BIN)
    if " bench " in f" {command} " and "--url" not in command:
        command += f" --url {server.url}"
    return command


def run_section(section: Section, *extra_flags: str) -> list[str]:
    """Start the section's server, run its other commands and Python blocks; their outputs."""
    flags = section.serve_flags()
    assert flags is not None, f"{section.title}: no make serve line"
    outputs = []
    with running_server(*flags, *extra_flags, startup_timeout=LOAD_TIMEOUT) as server:
        for lang, code in section.blocks:
            if lang == "python":
                program = local(code, server)
                done = subprocess.run([sys.executable, "-c", program], cwd=REPO,
                                      capture_output=True, text=True, timeout=300)  # fmt: skip
                assert done.returncode == 0, f"{section.title}:\n{code}\n{done.stderr}"
                outputs.append(done.stdout)
            elif lang == "sh":
                for command in commands(code):
                    if command.startswith("make "):
                        continue  # the server itself, started above
                    done = subprocess.run(local(command, server), shell=True, cwd=REPO,
                                          capture_output=True, text=True, timeout=300)  # fmt: skip
                    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
                    outputs.append(done.stdout)
    return outputs


def test_the_readme_fits_on_a_few_screens_and_links_to_pages_that_exist() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", text):
        assert (REPO / target).exists(), target


def test_the_quickstart_make_targets_exist() -> None:
    lines = sections()["Quickstart"].shell_lines()
    targets = [shlex.split(line.split("#")[0])[1] for line in lines]
    assert targets == ["serve", "test", "test-fast"]
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_the_stand_in_example_runs_against_a_gpu_profile() -> None:
    stream, metrics, simulated = run_section(sections()["A GPU-free stand-in for vLLM"])
    assert re.fullmatch(r"\d+ chunks, the first after \d\.\d{3} s, all after \d\.\d{3} s\n", stream)
    assert "vllm:num_requests_waiting" in metrics and "vllm:kv_cache_usage_perc" in metrics
    assert "reports in /tmp/simulated" in simulated


def test_the_learning_examples_run() -> None:
    section = sections()["Learning continuous batching"]
    generated, bench = run_section(section)
    assert [line.split()[0] for line in generated.splitlines()] == ["a", "b"]
    assert "requests completed" in bench and "100" in bench


@pytest.mark.real_model
def test_the_small_model_example_answers() -> None:
    from hf_smollm2 import smollm2_cache_dir

    section = sections()["A small model on one machine"]
    (answer,) = run_section(section, "--model-cache-dir", str(smollm2_cache_dir()))
    assert "Paris" in answer
