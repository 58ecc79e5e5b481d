"""The same shared-prefix workload through the vLLM router's policies, in front of slotserve
replicas that keep a GPU's time (a ``--profile``, or ``--model-config`` on ``--gpu``).

Per setup (one policy: fresh replicas, so every cache starts empty, and a fresh router): groups
of prompts share a long system prompt and differ in a question; the requests arrive in a random
order (Poisson, ``--rate``), streamed through the router. Reported per policy: TTFT and ITL
(p50, p90, mean, measured by this client through the router) and the prefix-cache hit rate
(prompt tokens the replicas took from their caches over all prompt tokens they looked up,
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` summed over replicas).
A router that sends a group where its prefix is cached computes less prefill: shorter TTFT,
fewer long prefills in the batch (shorter ITL).

    flock /tmp/bench.lock python benchmarks/routers.py --profile llama3.1-8b-h100

Two more setups compare prefill/decode disaggregation with the same GPUs used whole:
``pd`` is the router's P/D mode (``--vllm-pd-disaggregation``) before one producer and one
consumer (``--kv-transfer-config``; the consumer pulls each prompt's KV over the simulated
link), ``combined`` is round robin over two ordinary replicas.

Needs ``vllm-router`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _serve import free_port, started
from prometheus_client.parser import text_string_to_metric_families

MODEL = "slotserve-mock"
POLICIES = ("round_robin", "cache_aware", "kv_aware")
PD_SETUPS = ("pd", "combined")  # 1 prefill + 1 decode replica, against 2 combined replicas
PD_CONFIG = '{{"kv_connector":"NixlConnector","kv_role":"{}"}}'
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


@dataclass
class Result:
    policy: str
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    itl: list[float] = field(default_factory=list)  # seconds, every gap between chunks
    hits: float = 0.0
    queries: float = 0.0
    failed: int = 0

    def summary(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, float]:
            if not values:
                return {}
            ordered = sorted(values)

            def pick(q: float) -> float:
                return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

            return {"p50_ms": pick(0.5) * 1e3, "p90_ms": pick(0.9) * 1e3,
                    "mean_ms": statistics.fmean(values) * 1e3}  # fmt: skip

        return {"policy": self.policy, "requests": len(self.ttft), "failed": self.failed,
                "ttft": stats(self.ttft), "itl": stats(self.itl),
                "prefix_hit_rate": self.hits / self.queries if self.queries else 0.0}  # fmt: skip


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text (the mocks' byte tokenizer: one token per byte)."""
    out = ""
    while len(out) < tokens:
        out += rng.choice(WORDS) + " "
    return out[:tokens]


def workload(args: argparse.Namespace) -> list[str]:
    """Every prompt, shuffled: ``--groups`` system prompts x ``--per-group`` questions."""
    rng = random.Random(args.seed)
    prompts = [
        system + text(rng, args.question_len)
        for system in (text(rng, args.system_len) for _ in range(args.groups))
        for _ in range(args.per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def replica_flags(args: argparse.Namespace) -> list[str]:
    gpu = ["--profile", args.profile] if args.model_config is None else [
        "--model-config", args.model_config, "--gpu", args.gpu]  # fmt: skip
    return [*gpu, "--enable-prefix-caching", "--block-size", "16"]


@contextmanager
def replicas(args: argparse.Namespace, setup: str) -> Iterator[tuple[list[str], list[str]]]:
    """Start the servers of ``setup`` (a policy: ``--replicas`` of them; ``pd``: a producer and
    a consumer; ``combined``: two); yield their URLs and the router's flags for them."""
    urls, sources = [], []
    roles: list[str | None] = [None] * (2 if setup == "combined" else args.replicas)
    if setup == "pd":
        roles = ["kv_producer", "kv_consumer"]
    with ExitStack() as stack:
        for role in roles:
            port, events = free_port(), free_port()
            command = [sys.executable, "-m", "app", "serve", "--port", str(port),
                       "--log-level", "warning", *replica_flags(args),
                       "--kv-events-endpoint", f"tcp://*:{events}"]  # fmt: skip
            if role is not None:
                command += ["--kv-transfer-config", PD_CONFIG.format(role)]
            url = stack.enter_context(started(command, port))
            urls.append(url)
            sources += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        if setup == "pd":
            flags = ["--policy", "round_robin", "--vllm-pd-disaggregation", "--prefill", urls[0],
                     "--decode", urls[1], "--kv-connector", "nixl"]  # fmt: skip
        else:
            policy = "round_robin" if setup == "combined" else setup
            flags = ["--policy", policy, "--worker-urls", *urls]
            if policy == "kv_aware":
                flags += [*sources, "--kv-event-model", MODEL]
        yield urls, flags


def prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) summed over the replicas."""
    hits = queries = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


async def one(http: httpx.AsyncClient, url: str, prompt: str, args: argparse.Namespace,
              result: Result) -> None:  # fmt: skip
    body = {"model": MODEL, "prompt": prompt, "max_tokens": args.output_len, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    last: float | None = None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft.append(now - start)
                else:
                    result.itl.append(now - last)
                last = now
    except httpx.HTTPError:
        result.failed += 1


async def drive(url: str, prompts: list[str], args: argparse.Namespace, result: Result) -> None:
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as http:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(http, url, prompt, args, result)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)


def run(args: argparse.Namespace, policy: str, router_bin: str) -> Result:
    result = Result(policy)
    prompts = workload(args)
    with replicas(args, policy) as (urls, flags):
        port = free_port()
        command = [router_bin, "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-port", str(free_port()), "--log-level", "warning",
                   *flags]  # fmt: skip
        with started(command, port, output=subprocess.DEVNULL) as router:  # its log is loud
            hits, queries = prefix_counts(urls)
            asyncio.run(drive(router, prompts, args, result))
            after = prefix_counts(urls)
            result.hits, result.queries = after[0] - hits, after[1] - queries
    return result


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT and ITL (p50 or mean, p90) and the prefix hit rate per setup, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["policy"] for row in rows]
    x = range(len(rows))
    fig, (ttft, itl, hits) = plt.subplots(1, 3, figsize=(12, 3.5))
    for axis, metric, first in ((ttft, "ttft", "mean_ms"), (itl, "itl", "p50_ms")):
        for offset, key in ((-0.2, first), (0.2, "p90_ms")):
            axis.bar([i + offset for i in x], [row[metric][key] for row in rows], width=0.4,
                     label=f"{metric.upper()} {key.split('_')[0]}")  # fmt: skip
        axis.set_xticks(list(x), names)
        axis.set_ylabel("ms")
        axis.set_ylim(0, 1.35 * max(row[metric]["p90_ms"] for row in rows))  # legend room
        axis.legend(loc="upper center", ncol=2)
    hits.bar(list(x), [100 * row["prefix_hit_rate"] for row in rows], width=0.5)
    hits.set_xticks(list(x), names)
    hits.set_ylabel("prefix-cache hit rate (%)")
    hits.set_ylim(0, 100)
    fig.suptitle(f"through the vLLM router ({title})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--policies", default=",".join(POLICIES),
        help=f"setups, comma-separated: the policies, and {' and '.join(PD_SETUPS)} (P/D)",
    )  # fmt: skip
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=2000, help="shared prefix tokens")
    parser.add_argument("--question-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="llama3.1-8b-h100")
    parser.add_argument("--model-config", help="a config.json (then --gpu, not --profile)")
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--chart", type=Path, help="draw them here (PNG, needs matplotlib)")
    args = parser.parse_args()
    router_bin = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
        "vllm-router"
    )
    if router_bin is None:
        raise SystemExit("vllm-router not found: pip install -e '.[test]'")
    rows = [run(args, policy, router_bin).summary() for policy in args.policies.split(",")]
    print(f"{'policy':<14}{'TTFT p50':>10}{'p90':>10}{'mean':>10}{'ITL p50':>10}{'p90':>9}"
          f"{'hit rate':>10}{'failed':>8}")  # fmt: skip
    for row in rows:
        t, i = row["ttft"], row["itl"]
        print(f"{row['policy']:<14}{t['p50_ms']:>8.1f}ms{t['p90_ms']:>8.1f}ms{t['mean_ms']:>8.1f}ms"
              f"{i['p50_ms']:>8.1f}ms{i['p90_ms']:>7.1f}ms{row['prefix_hit_rate']:>10.1%}"
              f"{row['failed']:>8}")  # fmt: skip
    if args.chart:
        chart(rows, args.chart, args.model_config or args.profile)
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": settings, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
