"""``slotserve simulate``: replay an inference-perf config or a trace on a virtual clock.

    python -m app simulate --inference-perf-config FILE --model-config config.json \\
        --gpu h100-sxm --tensor-parallel-size 1 --max-num-seqs 128 \\
        --max-num-batched-tokens 2048 --max-model-len 4096 --output DIR

Writes inference-perf's report files to ``--output`` and prints a short table. vLLM's defaults
where they shape latency: the KV cache vLLM would get (``app.step_time.physics``), 16-token
blocks, prefix caching on, chunked prefill (decodes first), preemption by recompute.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from app import checks
from app.bench.cli import DefaultsFormatter
from app.engine.scheduler import SchedulerConfig
from app.engine.step_clock import StepClock, StepCosts, StepTimeModel
from app.simulate.report import Client, reports, table, write_reports
from app.simulate.run import CLIENT_TIMEOUT, Overheads, simulate
from app.simulate.workload import (
    MAX_REQUEST_TOKENS,
    Workload,
    WorkloadError,
    load_inference_perf,
    load_trace,
)
from app.step_time.gpus import UnknownGpuError, gpu
from app.step_time.model_config import ModelConfigError, load_model_config
from app.step_time.physics import (
    DEFAULT_CALIBRATION,
    PhysicsStepTime,
    kv_cache_tokens,
    require_kv_room,
)
from app.step_time.settings import only_with_model_config

DEFAULT_VOCAB = 32000  # token ids of a linear profile's workload (only their equality matters)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotserve simulate",
        description="Replay a workload through the server's scheduler and step clock in virtual "
        "time; write inference-perf's report files.",
        formatter_class=DefaultsFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--inference-perf-config", type=Path, help="inference-perf config (YAML/JSON)"
    )
    source.add_argument("--trace", type=Path, help="JSONL trace (see app/simulate/workload.py)")
    hw = p.add_mutually_exclusive_group(required=True)
    hw.add_argument("--model-config", type=Path, help="the model's Hugging Face config.json")
    hw.add_argument("--profile", help="a linear BLIS profile instead (app/profiles.py)")
    p.add_argument(
        "--gpu",
        default=None,
        help="with --model-config: GPU datasheet (app/step_time/gpus.py); default h100-sxm",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="with --model-config; default 1"
    )
    p.add_argument("--max-num-seqs", "--num-slots", dest="max_num_seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="default: what vLLM gets")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--client-timestamps-per-token",
        type=int,
        default=2,
        help="2: inference-perf as in the shared measurements; 1: an exact client",
    )
    p.add_argument("--client-timeout", type=float, default=CLIENT_TIMEOUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="directory for the report files")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, config, overheads, vocab = _setup(args)
        workload = _workload(args, vocab, config.max_model_len)
    except (ModelConfigError, UnknownGpuError, WorkloadError, ValueError) as exc:
        parser.error(str(exc))
    client = Client(
        args.client_timestamps_per_token, 2 if args.client_timestamps_per_token > 1 else 0
    )
    started = time.perf_counter()
    runs = simulate(workload, config, StepClock(model, args.seed), overheads, args.client_timeout)
    elapsed = time.perf_counter() - started
    files = reports(runs, client)
    if args.output is not None:
        write_reports(files, args.output)
    print(table(files, runs))
    simulated = runs[-1].end if runs else 0.0
    print(
        f"simulated {simulated:.0f} s in {elapsed:.1f} s"
        + (f"; reports in {args.output}" if args.output else "")
    )
    return 0


def _setup(args: argparse.Namespace) -> tuple[StepTimeModel, SchedulerConfig, Overheads, int]:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_model_len is not None:
        checks.integer(args.max_model_len, "--max-model-len", minimum=1,
                       maximum=MAX_REQUEST_TOKENS)  # fmt: skip
    checks.number(args.gpu_memory_utilization, "--gpu-memory-utilization", above=0, maximum=1)
    checks.positive(args.client_timeout, "--client-timeout")
    if args.profile is not None:
        only_with_model_config([f for f, v in (("--gpu", args.gpu), ("--tensor-parallel-size",
                                args.tensor_parallel_size)) if v is not None])  # fmt: skip
        from app.profiles import PROFILE_LIMITS, PROFILES

        if args.profile not in PROFILES:
            raise ValueError(f"unknown --profile {args.profile!r}; known: {', '.join(PROFILES)}")
        preset = PROFILES[args.profile]
        model: StepTimeModel = StepCosts(preset.step_us / 1000, preset.prefill_token_us / 1000,
                                         preset.decode_token_us / 1000)  # fmt: skip
        kv, vocab, overheads = preset.kv_cache_tokens, DEFAULT_VOCAB, Overheads()
        longest = args.max_model_len or PROFILE_LIMITS["max_model_len"]
    else:
        shape = load_model_config(args.model_config)
        device = gpu(args.gpu or "h100-sxm")
        tp = 1 if args.tensor_parallel_size is None else args.tensor_parallel_size
        model = PhysicsStepTime(shape, device, tp)
        kv = kv_cache_tokens(shape, device, tp, args.max_num_batched_tokens, args.max_num_seqs,
                             args.gpu_memory_utilization)  # fmt: skip
        longest = args.max_model_len or shape.max_position
        vocab = shape.vocab
        cal = DEFAULT_CALIBRATION
        overheads = Overheads(cal.api_ms / 1000, cal.post_ms / 1000)
        if args.kv_cache_tokens is None:
            require_kv_room(kv, args.block_size, shape, device, tp, args.gpu_memory_utilization)
    if args.kv_cache_tokens is not None:
        kv = args.kv_cache_tokens
    if kv < args.block_size:
        raise ValueError(f"--kv-cache-tokens {kv} holds less than one {args.block_size}-token "
                         "block")  # fmt: skip
    config = SchedulerConfig(
        num_slots=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
        block_size=args.block_size,
        kv_cache_tokens=kv,
        max_model_len=longest,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return model, config, overheads, vocab


def _workload(args: argparse.Namespace, vocab: int, max_len: int | None) -> Workload:
    if args.trace is not None:
        return load_trace(args.trace, vocab, args.seed, max_len)
    return load_inference_perf(args.inference_perf_config, vocab, args.seed, max_len)


if __name__ == "__main__":
    sys.exit(main())
