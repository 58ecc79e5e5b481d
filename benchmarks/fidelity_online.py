"""The server's emulation ceiling: `serve --model-config` under load vs `simulate` (issue 28).

For each request rate: a real `python -m app serve --model-config llama-2-7b --gpu h100-sxm`
(128 slots, 2,048-token budget, prefix caching off so prompts cost the same on both sides),
driven by `slotserve bench` on the same machine (OpenAI completions, streamed, Poisson arrivals,
575-token prompts, 249 output tokens, EOS ignored), against `simulate` of the same workload
(a Poisson trace of the same rate and size, an exact client). The server keeps up while its
TPOT stays within 5% of the simulation's; the output tokens/s and open streams at which it
drifts past that are its ceiling on this machine.

Run: PYTHONPATH=. flock /tmp/bench.lock python benchmarks/fidelity_online.py [--rates 4,8,12,16,20]
     [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--model-config", "llama-2-7b", "--gpu", "h100-sxm", "--max-num-seqs", "128",
         "--max-num-batched-tokens", "2048", "--max-model-len", "4096"]  # fmt: skip
PROMPT, OUTPUT = 575, 249


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def online(rate: float, count: int, out: Path) -> dict[str, Any]:
    port = free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port),
                               "--log-level", "warning", "--max-waiting", "100000",
                               "--no-enable-prefix-caching", *FLAGS], cwd=ROOT, env=env)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # the server process is starting: nothing to await
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        subprocess.run([sys.executable, "-m", "app", "bench", "--url", url, "--api", "openai",
                        "--model", model, "--num-requests", str(count), "--request-rate",
                        str(rate), "--prompt-len", str(PROMPT), "--output-len", str(OUTPUT),
                        "--json", str(out), "--no-progress", "--monitor", "off"],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    body: dict[str, Any] = json.loads(out.read_text())
    return body


def simulated(rate: float, count: int, work: Path) -> dict[str, Any]:
    from app.simulate.cli import main

    rng, t, lines = random.Random(1), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        lines.append(json.dumps({"arrival": t, "prompt_len": PROMPT, "output_len": OUTPUT}))
    trace = work / f"trace-{rate}.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = work / f"sim-{rate}"
    main(["--trace", str(trace), *FLAGS, "--no-enable-prefix-caching",
          "--client-timestamps-per-token", "1", "--output", str(out)])  # fmt: skip
    report: dict[str, Any] = json.loads((out / "stage_0_lifecycle_metrics.json").read_text())
    return report


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", default="4,8,12,16,20")
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rate in (float(r) for r in args.rates.split(",")):
            count = int(rate * args.seconds)
            on = online(rate, count, work / f"online-{rate}.json")
            sim = simulated(rate, count, work)["successes"]
            lat = sim["latency"]
            sim_tpot = lat["time_per_output_token"]["mean"] * 1e3
            sim_ttft = lat["time_to_first_token"]["mean"] * 1e3
            streams = rate * lat["request_latency"]["mean"]
            row = {"rate": rate, "output_tok_s": on["output_throughput"], "open_streams": streams,
                   "tpot_ms": (on["tpot_ms"]["mean"], sim_tpot),
                   "ttft_ms": (on["ttft_ms"]["mean"], sim_ttft), "failed": on.get("failed", 0)}  # fmt: skip
            rows.append(row)
            drift = (on["tpot_ms"]["mean"] / sim_tpot - 1) * 100
            print(f"rate {rate:>5g}: {on['output_throughput']:>6.0f} tok/s, ~{streams:.0f} streams, "
                  f"TPOT online {on['tpot_ms']['mean']:.2f} vs sim {sim_tpot:.2f} ms ({drift:+.1f}%), "
                  f"TTFT {on['ttft_ms']['mean']:.1f} vs {sim_ttft:.1f} ms", flush=True)  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
