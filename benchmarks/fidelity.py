"""Does a `--profile` server time its tokens as the profile predicts? (docs/fidelity.md)

Each section starts real `python -m app serve --profile ...` processes on 127.0.0.1 and compares
what a client (and the server's own histograms) measures with the step clock's prediction:

1. per profile: inter-token latency of B concurrent streams (B = 1, 8, 32; one step decodes B
   tokens: b0 + b2*B), time to first token of a lone 128- and 1,024-token prompt (one step:
   b0 + b1*P), a lone 4,096-token prompt (the chunk schedule: one chunk at the profile's budget
   of 8,192, four at --max-num-batched-tokens 1024: b0 per chunk), and batch 128 from the
   server's `vllm:inter_token_latency_seconds` (128 non-streamed requests: the client would
   saturate the cores reading 128 streams);
2. llama3.1-8b-h100 under Poisson load, 0.25 to 1.2 of its capacity, TTFT and ITL from the
   server's histograms next to the steady-state prediction and the knee;
3. KV pressure: a small --kv-cache-tokens makes preemptions; every output equals the output of
   a server without pressure, and `vllm:kv_cache_usage_perc` (polled) stays <= 1;
4. prefix cache: 100 requests sharing a 1,000-token system prompt, with and without
   --enable-prefix-caching: hit rate and TTFT.

Medians of repeats. The machine is shared, so deviations include other processes' load.

Run: PYTHONPATH=. /work/venv/bin/python benchmarks/fidelity.py [--quick] [--out docs/fidelity]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.profiles import PROFILES, GpuProfile

ROOT = Path(__file__).resolve().parents[1]
H100 = "llama3.1-8b-h100"
Results = dict[str, Any]


# --- predictions ------------------------------------------------------------------------------


def step_s(p: GpuProfile, prefill: int = 0, decode: int = 0) -> float:
    """The step clock: b0 + b1 * prefill + b2 * decode, in seconds."""
    return (p.step_us + p.prefill_token_us * prefill + p.decode_token_us * decode) / 1e6


def chunked_ttft_s(p: GpuProfile, prompt: int, budget: int) -> float:
    """A lone prompt prefilled in chunks of ``budget``: b0 per chunk, b1 per token."""
    chunks = -(-prompt // budget)
    return chunks * p.step_us / 1e6 + p.prefill_token_us * prompt / 1e6


def load_model(p: GpuProfile, rate: float, prompt: int, output: int, slots: int) -> Results:
    """Steady state at ``rate`` requests/s: a step lasts T = b0 + b2*n + b1*P*rate*T with
    n = rate*O*T running (Little), so T = b0 / (1 - rate*(b2*O + b1*P)). TTFT ~ the rest of
    the step under way (T/2) plus the step that admits it, which also prefills its own prompt
    (T + b1*P). Past the knee every slot is busy: steps last the saturated T and the queue,
    so TTFT, grows without bound (no steady state: None)."""
    b0, b1, b2 = p.step_us / 1e6, p.prefill_token_us / 1e6, p.decode_token_us / 1e6
    if rate >= knee_rate(p, prompt, output, slots):
        step = b0 + b2 * slots + b1 * prompt * slots / output
        return {"itl": step, "ttft": None, "running": slots}
    step = b0 / (1 - rate * (b2 * output + b1 * prompt))
    return {"itl": step, "ttft": 1.5 * step + b1 * prompt, "running": rate * output * step}


def knee_rate(p: GpuProfile, prompt: int, output: int, slots: int) -> float:
    """The arrival rate at which all slots are busy: n = slots with T at that load."""
    b0, b1, b2 = p.step_us / 1e6, p.prefill_token_us / 1e6, p.decode_token_us / 1e6
    step = b0 + b2 * slots + b1 * prompt * slots / output
    return slots / (output * step)


# --- servers and clients ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server(*flags: str) -> Iterator[str]:
    port = free_port()
    args = [sys.executable, "-m", "app", "serve", "--port", str(port), "--log-level", "warning",
            "--mock-stop-probability", "0", *flags]  # fmt: skip
    process = subprocess.Popen(args, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)  # another process binding: nothing to await
        yield url
    finally:
        process.terminate()
        process.wait(15)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(32, 127) for _ in range(length)]


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> Results:
    """One streamed request: client-side TTFT and the arrival time of every token."""
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
    arrivals: list[float] = []
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "token":
                now = time.perf_counter()
                arrivals += [now] * len(json.loads(line[5:])["tokens"])
    gaps = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
    return {"ttft": arrivals[0] - start, "itl": gaps, "tokens": len(arrivals)}


def text_of(length: int, salt: int = 0) -> str:
    """``length`` printable ASCII characters: ``length`` tokens for the byte-level mock, and
    cheaper than token ids for both sides to encode and parse under load."""
    return "".join(map(chr, prompt_of(length, salt)))


async def complete(
    client: httpx.AsyncClient, url: str, prompt: list[int] | str, tokens: int
) -> Results:
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": False}
    r = await client.post(f"{url}/generate", json=body)
    r.raise_for_status()
    result: Results = r.json()
    return result


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Every sample of /metrics summed over labels other than le (name -> value)."""
    text = (await client.get(f"{url}/metrics")).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"|{s.labels['le']}" if "le" in s.labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def mean_of(before: dict[str, float], after: dict[str, float], hist: str) -> float:
    count = after[f"{hist}_count"] - before[f"{hist}_count"]
    return (after[f"{hist}_sum"] - before[f"{hist}_sum"]) / count if count else float("nan")


@contextlib.asynccontextmanager
async def client_for(connections: int = 300) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=connections,
        keepalive_expiry=1.0,  # before uvicorn's 5 s: never reuse a connection it is closing
    )
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        yield client


# --- 1. each profile --------------------------------------------------------------------------


NO_STEP_TIME = GpuProfile("baseline", 0, 0, 0, 0, 0, 0, 0, 0, 0)  # HTTP and engine overhead


async def profile_section(p: GpuProfile, url: str, repeats: int) -> Results:
    """Measured and predicted seconds for each quantity (client-side unless ``_server``)."""
    out: Results = {}
    async with client_for() as client:
        await complete(client, url, prompt_of(16), 4)  # warm up
        for batch in (1, 8, 32):
            runs, server_side = [], []
            for r in range(repeats):
                streams = [stream(client, url, prompt_of(16, 100 * r + i), 48)
                           for i in range(batch)]  # fmt: skip
                before = await scrape(client, url)
                runs.append(statistics.median(s["itl"] for s in await asyncio.gather(*streams)))
                after = await scrape(client, url)
                server_side.append(mean_of(before, after, "vllm:inter_token_latency_seconds"))
            out[f"itl_b{batch}"] = (statistics.median(runs), step_s(p, decode=batch))
            out[f"itl_b{batch}_server"] = (statistics.median(server_side), step_s(p, decode=batch))
        for length in (128, 1024, 4096):
            runs, server_side = [], []
            for r in range(repeats):
                before = await scrape(client, url)
                runs.append((await stream(client, url, prompt_of(length, r), 2))["ttft"])
                after = await scrape(client, url)
                server_side.append(mean_of(before, after, "vllm:time_to_first_token_seconds"))
            predicted = chunked_ttft_s(p, length, 8192)
            out[f"ttft_{length}"] = (statistics.median(runs), predicted)
            out[f"ttft_{length}_server"] = (statistics.median(server_side), predicted)
        out["itl_b128_server"] = (await steady_itl(client, url, 128), step_s(p, decode=128))
    return out


async def steady_itl(client: httpx.AsyncClient, url: str, batch: int) -> float:
    """The server's mean inter-token latency while ``batch`` non-streamed requests all decode
    (a window after the last is admitted and before the first finishes)."""
    tokens = 400
    tasks = [asyncio.create_task(complete(client, url, prompt_of(16, i), tokens))
             for i in range(batch)]  # fmt: skip
    deadline = time.monotonic() + 60
    while (await scrape(client, url))["vllm:num_requests_running"] < batch:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{batch} requests never ran at once")
        await asyncio.sleep(0.01)  # polling another process's state: no event to await
    before = await scrape(client, url)
    await asyncio.sleep(1.0)  # the measurement window (the requests run for ~400 steps)
    after = await scrape(client, url)
    await asyncio.gather(*tasks)
    return mean_of(before, after, "vllm:inter_token_latency_seconds")


async def chunked_section(url: str, repeats: int) -> Results:
    p = PROFILES[H100]
    predicted = chunked_ttft_s(p, 4096, 1024)
    runs, server_side = [], []
    async with client_for() as client:
        for r in range(repeats):
            before = await scrape(client, url)
            runs.append((await stream(client, url, prompt_of(4096, r), 2))["ttft"])
            after = await scrape(client, url)
            server_side.append(mean_of(before, after, "vllm:time_to_first_token_seconds"))
    return {
        "ttft_4096_budget1024": (statistics.median(runs), predicted),
        "ttft_4096_budget1024_server": (statistics.median(server_side), predicted),
    }


# --- 2. load ----------------------------------------------------------------------------------

LOAD_PROMPT, LOAD_OUTPUT = 512, 128


async def load_point(url: str, rate: float, seconds: float, seed: int) -> Results:
    rng = random.Random(seed)
    async with client_for(2000) as client:
        before = await scrape(client, url)
        tasks, start, t, waiting = [], time.perf_counter(), 0.0, 0.0
        while t < seconds:
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = text_of(LOAD_PROMPT, rng.randrange(1 << 30))
            tasks.append(asyncio.create_task(complete(client, url, prompt, LOAD_OUTPUT)))
            t += rng.expovariate(rate)
        waiting = (await scrape(client, url)).get("vllm:num_requests_waiting", 0.0)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        after = await scrape(client, url)
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    return {
        "rate": rate,
        "offered": len(tasks) / seconds,
        "ttft": mean_of(before, after, "vllm:time_to_first_token_seconds"),
        "itl": mean_of(before, after, "vllm:inter_token_latency_seconds"),
        "queue": mean_of(before, after, "vllm:request_queue_time_seconds"),
        "waiting_at_end": waiting,
        "client_errors": len(errors),  # connections reset under load (not the server's answer)
        "first_error": errors[0] if errors else None,
    }


async def load_section(url: str, seconds: float, fractions: list[float]) -> Results:
    p = PROFILES[H100]
    knee = knee_rate(p, LOAD_PROMPT, LOAD_OUTPUT, 256)
    points = []
    for i, fraction in enumerate(fractions):
        point = await load_point(url, fraction * knee, seconds, i)
        point |= {"fraction": fraction, "predicted": load_model(p, point["rate"], LOAD_PROMPT,
                                                                 LOAD_OUTPUT, 256)}  # fmt: skip
        print(f"  load {fraction:.2f}: {json.dumps(point)}", flush=True)
        points.append(point)
    return {"knee_rate": knee, "points": points}


# --- 3. KV pressure ---------------------------------------------------------------------------


async def kv_section(small: str, roomy: str) -> Results:
    prompts = [prompt_of(300, 7000 + i) for i in range(48)]
    usage: list[float] = []
    async with client_for() as client:
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                usage.append((await scrape(client, small))["vllm:kv_cache_usage_perc"])
                await asyncio.sleep(0.02)  # a sampling period, not a synchronisation

        poller = asyncio.create_task(poll())
        pressured = await asyncio.gather(*(complete(client, small, p, 200) for p in prompts))
        done.set()
        await poller
        metrics = await scrape(client, small)
        reference = await asyncio.gather(*(complete(client, roomy, p, 200) for p in prompts))
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(pressured, reference, strict=True))
    return {
        "requests": len(prompts),
        "identical_outputs": same,
        "completed": sum(r["finish_reason"] == "length" for r in pressured),
        "preemptions": metrics["vllm:num_preemptions_total"],
        "max_usage": max(usage),
        "usage_samples": len(usage),
    }


# --- 4. prefix cache --------------------------------------------------------------------------


async def prefix_section(url: str) -> Results:
    system = prompt_of(1000, 42)
    ttfts: list[float] = []
    async with client_for() as client:
        before = await scrape(client, url)
        for i in range(100):
            question = prompt_of(24, 5000 + i)
            ttfts.append((await stream(client, url, system + question, 8))["ttft"])
        after = await scrape(client, url)
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    return {
        "ttft_median": statistics.median(ttfts[1:]),
        "ttft_first": ttfts[0],
        "ttft_server_mean": mean_of(before, after, "vllm:time_to_first_token_seconds"),
        "hit_rate": hits / queries if queries else 0.0,
        "queries": queries,
        "hits": hits,
    }


# --- charts and main --------------------------------------------------------------------------


def charts(results: Results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    keys = ["itl_b1", "itl_b8", "itl_b32", "itl_b1_server", "itl_b8_server", "itl_b32_server",
            "itl_b128_server", "ttft_128_server", "ttft_1024_server", "ttft_4096_server",
            "ttft_128", "ttft_1024", "ttft_4096"]  # fmt: skip
    base = results.get("baseline", {})
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(len(results["profiles"]), 1)
    for i, (name, values) in enumerate(results["profiles"].items()):
        deviations = []
        for k in keys:
            measured, predicted = values[k]
            if k.startswith("ttft") and not k.endswith("_server"):  # client: less HTTP overhead
                measured -= base.get(k, [0.0])[0]
            deviations.append(100 * (measured / predicted - 1))
        ax.bar([j + width * (i - 1.5) for j in range(len(keys))], deviations, width, label=name)
    ax.axhspan(-5, 5, color="green", alpha=0.1, label="within 5%")
    ax.axhline(0, color="black", lw=0.6)
    labels = [k.replace("_server", " (server)") if k.endswith("_server") or k.startswith("itl")
              else f"{k} (client - baseline)" for k in keys]  # fmt: skip
    ax.set_xticks(range(len(keys)), labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("measured / predicted - 1 (%)")
    ax.set_title("Each profile against its own prediction (median of repeats, over HTTP)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "profiles.png", dpi=90)
    if "load" in results:
        load = results["load"]
        pts = load["points"]
        for pt in pts:  # the model as it is now (the saved one may be older)
            pt["predicted"] = load_model(PROFILES[H100], pt["rate"], LOAD_PROMPT, LOAD_OUTPUT, 256)
        fig, ax = plt.subplots(figsize=(7, 4))
        loads = [pt["fraction"] for pt in pts]
        ax.plot(loads, [pt["ttft"] * 1000 for pt in pts], "o-", label="TTFT measured")
        below = [pt for pt in pts if pt["predicted"]["ttft"] is not None]
        ax.plot([pt["fraction"] for pt in below], [pt["predicted"]["ttft"] * 1000 for pt in below],
                "--", label="TTFT predicted (past the knee: grows)")  # fmt: skip
        ax.plot(loads, [pt["itl"] * 1000 for pt in pts], "s-", label="ITL measured")
        ax.plot(loads, [pt["predicted"]["itl"] * 1000 for pt in pts], ":", label="ITL predicted")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.text(1.0, ax.get_ylim()[1] * 0.9, f" knee {load['knee_rate']:.0f} req/s", fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel(f"offered load / capacity ({LOAD_PROMPT}-token prompts, "
                      f"{LOAD_OUTPUT} tokens out)")  # fmt: skip
        ax.set_ylabel("ms (server histograms, mean)")
        ax.set_title(H100)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "load.png", dpi=90)


def pct(measured: float, predicted: float) -> str:
    return f"{100 * (measured / predicted - 1):+.1f}%" if predicted else ""


def markdown(results: Results) -> str:
    """The tables of docs/fidelity.md."""
    lines, base = [], results.get("baseline", {})
    rows = ["itl_b1", "itl_b1_server", "itl_b8", "itl_b8_server", "itl_b32", "itl_b32_server",
            "itl_b128_server", "ttft_128", "ttft_128_server", "ttft_1024", "ttft_1024_server",
            "ttft_4096", "ttft_4096_server"]  # fmt: skip
    for name, values in results.get("profiles", {}).items():
        lines += [f"\n`{name}` (ms)\n", "| quantity | predicted | measured | deviation | "
                  "no-step-time baseline | measured - baseline | deviation |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for key in rows:
            measured, predicted = values[key]
            row = f"| {key} | {predicted * 1e3:.2f} | {measured * 1e3:.2f} | "
            row += f"{pct(measured, predicted)} | "
            if key.startswith("ttft") and key in base:  # pacing absorbs ITL overhead: no baseline
                b = base[key][0]
                row += (
                    f"{b * 1e3:.2f} | {(measured - b) * 1e3:.2f} | {pct(measured - b, predicted)} |"
                )
            else:
                row += " | | |"
            lines.append(row)
    for key, (measured, predicted) in results.get("chunks", {}).items():
        lines.append(f"\n{key} (4 chunks): predicted {predicted * 1e3:.2f} ms, measured "
                     f"{measured * 1e3:.2f} ms ({pct(measured, predicted)})")  # fmt: skip
    if "load" in results:
        lines += [f"\nLoad (knee {results['load']['knee_rate']:.1f} req/s)\n",
                  "| load | req/s | TTFT pred | TTFT | ITL pred | ITL | queue time | "
                  "waiting at end |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for pt in results["load"]["points"]:
            pred = load_model(PROFILES[H100], pt["rate"], LOAD_PROMPT, LOAD_OUTPUT, 256)
            ttft = "grows" if pred["ttft"] is None else f"{pred['ttft'] * 1e3:.1f}"
            lines.append(f"| {pt['fraction']:.2f} | {pt['offered']:.1f} | {ttft} | "
                         f"{pt['ttft'] * 1e3:.1f} | "
                         f"{pred['itl'] * 1e3:.2f} | {pt['itl'] * 1e3:.2f} | "
                         f"{pt['queue'] * 1e3:.1f} | {pt['waiting_at_end']:.0f} |")  # fmt: skip
    if "kv" in results:
        lines.append(f"\nKV pressure: {json.dumps(results['kv'])}")
    if "prefix" in results:
        lines.append(f"\nPrefix cache: {json.dumps(results['prefix'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter load runs")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "fidelity")
    parser.add_argument("--sections", default="baseline,profiles,chunks,load,kv,prefix")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma list")
    args = parser.parse_args()
    repeats, seconds = (3, 8.0) if args.quick else (5, 20.0)
    sections = set(args.sections.split(","))
    saved = args.out / "results.json"  # sections not run keep their saved results
    results: Results = json.loads(saved.read_text()) if saved.exists() else {}
    results.setdefault("profiles", {})

    def save(section: str) -> None:
        """Keep what is measured so far, with the machine's load average (1, 5, 15 min)."""
        results.setdefault("loadavg", {})[section] = os.getloadavg()
        args.out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(results, indent=1))

    if "baseline" in sections:
        limits = ("--num-slots", "256", "--max-num-batched-tokens", "8192")
        with server(*limits) as url:  # the same requests with no step time: the overhead
            results["baseline"] = asyncio.run(profile_section(NO_STEP_TIME, url, repeats))
        print("baseline", json.dumps(results["baseline"]), flush=True)
        save("baseline")
    if "profiles" in sections:
        for name in args.profiles.split(","):
            p = PROFILES[name]
            with server("--profile", name) as url:
                results["profiles"][name] = asyncio.run(profile_section(p, url, repeats))
            print(name, json.dumps(results["profiles"][name]), flush=True)
            save(name)
    if "chunks" in sections:
        with server("--profile", H100, "--max-num-batched-tokens", "1024") as url:
            results["chunks"] = asyncio.run(chunked_section(url, repeats))
        print("chunks", json.dumps(results["chunks"]), flush=True)
        save("chunks")
    if "load" in sections:
        with server("--profile", H100) as url:
            fractions = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.2]
            results["load"] = asyncio.run(load_section(url, seconds, fractions))
        save("load")
    if "kv" in sections:
        with (
            server("--profile", H100, "--kv-cache-tokens", "8192") as small,
            server("--profile", H100) as roomy,
        ):
            results["kv"] = asyncio.run(kv_section(small, roomy))
        print("kv", json.dumps(results["kv"]), flush=True)
        save("kv")
    if "prefix" in sections:
        results["prefix"] = {}
        for label, flags in (("off", ()), ("on", ("--enable-prefix-caching",))):
            with server("--profile", H100, *flags) as url:
                results["prefix"][label] = asyncio.run(prefix_section(url))
        p = PROFILES[H100]
        results["prefix"]["predicted"] = {"off": step_s(p, 1024), "on": step_s(p, 1024 - 992),
                                          "hit_rate": 99 * 992 / (100 * 1024)}  # fmt: skip
        print("prefix", json.dumps(results["prefix"]), flush=True)
        save("prefix")
    if results["profiles"]:
        charts(results, args.out)
    print(markdown(results))


if __name__ == "__main__":
    main()
