"""Online serving: Poisson arrivals against the OpenAI-compatible server, and its overhead
over the offline `LLM` on the same requests, in the manner of vLLM's serving benchmark.

    python -m benchmarks.serving [--quick] [--request-rates 1,2,4,inf] [--num-requests 64]
    python -m benchmarks.serving --base-url http://127.0.0.1:8000   # a server already running

Unless --base-url is given, the server (`python -m jpaged serve`, the default model
unless --model says otherwise) runs in a subprocess; this process is the load
generator. An untimed burst of the same lengths warms the server up first, and
an untimed pair the overhead runs; the shapes other runs meet for the first time
compile then (or load from the persistent compilation cache). --warmup instead
compiles every step shape in the server and the offline engine before timing:
all of them, so it takes long and holds every executable in memory.

Requests are seeded ShareGPT-like lengths (experiments.workloads,
scaled and clipped as benchmarks.throughput scales them) with random token-id
prompts, greedy with ignore_eos, so every request generates exactly its
max_tokens. Each run draws new prompt tokens (same lengths), so no run hits the
prefix cache of an earlier one.

Per request rate (Poisson arrivals; inf sends all at once): request throughput,
output tokens/s, TTFT / TPOT / end-to-end latency (mean, p50, p90, p99) and
normalized latency (end-to-end seconds per output token, mean), all from the
client's side of the streamed responses.

HTTP overhead: the same requests, all at once, through the server and through
an offline `LLM` with the same engine settings in this process (while the
server idles), alternating, `--overhead-runs` times each:
http_overhead_pct = (offline - HTTP) / offline output tokens/s, the median of
the runs' percentages. Every greedy HTTP output is compared with its offline
twin (`greedy_mismatches`). With --base-url the offline engine takes this
script's engine flags: they must match the server's.

Abort latency: one streamed request alone on the server; after its first
ABORT_AFTER_CHUNKS chunks the client closes the stream, and the latency is the time
until /metrics shows no running request (polled every few milliseconds): what a
client's disconnect waits for, a step or, with --num-decode-steps S, up to a loop of
S steps. The median of ABORT_TRIALS trials. --num-decode-steps and
--async-scheduling set those engine options on the server and the offline engine.

Prints progress to stderr and one JSON object last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.throughput import mixed_workload
from experiments.report import new_report, progress
from experiments.workloads import arrival_times

if TYPE_CHECKING:
    import openai

    from jpaged.entrypoints.llm import LLM

Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)
TARGET_OVERHEAD_PCT = 10.0
ABORT_AFTER_CHUNKS = 4
ABORT_TRIALS = 5
SERVER_START_TIMEOUT_S = 3600  # a first --warmup on a CPU compiles every shape


@dataclass(frozen=True)
class RequestResult:
    """One streamed request, timed on the client (seconds from its send)."""

    text: str
    output_tokens: int
    ttft: float
    e2e: float

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# The load generator.


async def send_request(client: openai.AsyncOpenAI, model: str, prompt: list[int],
                       max_tokens: int) -> RequestResult:
    """One greedy streamed completion of exactly max_tokens tokens."""
    started = time.perf_counter()
    first_token_time, pieces, usage = None, [], None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            first_token_time = first_token_time or time.perf_counter()
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    if first_token_time is None or usage is None:
        raise RuntimeError("a stream ended without output or usage")
    return RequestResult("".join(pieces), usage.completion_tokens, first_token_time - started,
                         ended - started)


async def run_load(base_url: str, api_key: str, model: str, workload: Workload,
                   request_rate: float, seed: int) -> tuple[list[RequestResult], float]:
    """Send the workload with Poisson arrivals at request_rate (inf: all at once).

    returns (results in workload order, seconds from the first send to the last reply)."""
    import openai

    arrivals = arrival_times(len(workload), request_rate, np.random.default_rng(seed))
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                                  timeout=3600) as client:
        started = time.perf_counter()

        async def at_arrival(arrival: float, prompt: list[int], max_tokens: int):
            await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
            return await send_request(client, model, prompt, max_tokens)

        results = await asyncio.gather(*(at_arrival(arrival, prompt, max_tokens)
                                         for arrival, (prompt, max_tokens)
                                         in zip(arrivals, workload, strict=True)))
    return list(results), time.perf_counter() - started


def load(args, base_url: str, model: str, workload: Workload, request_rate: float
         ) -> tuple[list[RequestResult], float]:
    """run_load on its own event loop."""
    return asyncio.run(run_load(base_url, args.api_key, model, workload, request_rate,
                                args.seed))


def num_running(base_url: str) -> int:
    """jpaged:num_requests_running from the server's /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("jpaged:num_requests_running"):
                return int(float(line.split()[-1]))
    raise RuntimeError("/metrics has no jpaged:num_requests_running")


async def abort_once(base_url: str, api_key: str, model: str, prompt: list[int],
                     max_tokens: int) -> float:
    """Seconds from closing a stream (after ABORT_AFTER_CHUNKS chunks) to the server
    running no request."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                                  timeout=3600) as client:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == ABORT_AFTER_CHUNKS:
                break
        await stream.close()
        closed = time.perf_counter()
    while await asyncio.to_thread(num_running, base_url):
        await asyncio.sleep(0.002)
    return time.perf_counter() - closed


def abort_latency(args, base_url: str, model: str, prompt: list[int]) -> dict:
    max_tokens = args.max_model_len - len(prompt)
    latencies = [asyncio.run(abort_once(base_url, args.api_key, model, prompt, max_tokens))
                 for _ in range(ABORT_TRIALS)]
    return {"trials_s": latencies, "median_s": float(np.median(latencies))}


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90 and p99 (None for no values)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    array = np.asarray(values)
    return {"mean": float(array.mean())} | {
        f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM's serving metrics over one run's requests."""
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "duration_s": duration,
        "completed": len(results),
        "output_tokens": output_tokens,
        "request_throughput": len(results) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "ttft_s": distribution([r.ttft for r in results]),
        "tpot_s": distribution([r.tpot for r in results if r.tpot is not None]),
        "e2e_s": distribution([r.e2e for r in results]),
        "normalized_latency_s_per_token": float(np.mean([r.e2e / r.output_tokens
                                                         for r in results])),
    }


def check_complete(results: list[RequestResult], workload: Workload) -> None:
    lost = [i for i, (r, (_, n)) in enumerate(zip(results, workload, strict=True))
            if r.output_tokens != n]
    if lost:
        raise RuntimeError(f"requests {lost[:5]} did not generate their max_tokens")


# The comparison with the offline engine.


def run_offline(llm: LLM, workload: Workload) -> tuple[list[str], float]:
    """The workload through LLM.generate, all at once: (texts, seconds)."""
    from jpaged.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params)
    return [o.outputs[0].text for o in outputs], time.perf_counter() - started


def http_overhead(args, base_url: str, model: str, llm: LLM, workloads: list[Workload]) -> dict:
    """Alternating HTTP and offline bursts, one pair per workload (the first pair warms
    both up and is not counted)."""
    runs = []
    for index, workload in enumerate(workloads):
        results, http_s = load(args, base_url, model, workload, math.inf)
        check_complete(results, workload)
        texts, offline_s = run_offline(llm, workload)
        tokens = sum(n for _, n in workload)
        run = {"http_output_tokens_per_s": tokens / http_s,
               "offline_output_tokens_per_s": tokens / offline_s,
               "greedy_mismatches": sum(r.text != t for r, t in zip(results, texts, strict=True))}
        run["http_overhead_pct"] = 100 * (1 - offline_s / http_s)
        label = "warm-up" if index == 0 else f"run {index}"
        progress(f"overhead {label}: HTTP {run['http_output_tokens_per_s']:.1f} tok/s, offline "
                  f"{run['offline_output_tokens_per_s']:.1f} tok/s")
        if index:
            runs.append(run)
    return {
        "runs": runs,
        "http_overhead_pct": float(np.median([r["http_overhead_pct"] for r in runs])),
        "greedy_mismatches": sum(r["greedy_mismatches"] for r in runs),
        "target_pct": f"<= {TARGET_OVERHEAD_PCT}",
    }


# The whole benchmark.


def workload_for(args, vocab_size: int, token_seed: int) -> Workload:
    """The run's request lengths (from --seed) with prompt tokens from token_seed."""
    return mixed_workload(args.num_requests, args.scale, vocab_size, args.seed, token_seed,
                          max_total_len=args.max_model_len)


def measure(args, base_url: str, llm: LLM) -> dict:
    """Every rate, then the overhead runs, against the server at base_url; `llm` is the
    offline engine with the server's settings."""
    model = served_model(base_url, args.api_key)
    vocab_size = llm.engine.model_config.vocab_size
    token_seeds = iter(range(args.seed + 1, args.seed + 1000))
    warmup = workload_for(args, vocab_size, next(token_seeds))
    started = time.perf_counter()
    load(args, base_url, model, warmup, math.inf)
    progress(f"server warm-up burst: {time.perf_counter() - started:.1f} s")
    by_rate = {}
    for rate in args.request_rates:
        workload = workload_for(args, vocab_size, next(token_seeds))
        results, duration = load(args, base_url, model, workload, rate)
        check_complete(results, workload)
        by_rate[str(rate)] = summarize(results, duration)
        progress(f"rate {rate}: {duration:.1f} s, "
                  f"{by_rate[str(rate)]['output_tokens_per_s']:.1f} output tok/s")
    abort = abort_latency(args, base_url, model, warmup[0][0])
    progress(f"abort latency: {abort['median_s'] * 1e3:.1f} ms")
    workloads = [workload_for(args, vocab_size, next(token_seeds))
                 for _ in range(args.overhead_runs + 1)]
    return {"by_rate": by_rate, "abort_latency": abort,
            "overhead": http_overhead(args, base_url, model, llm, workloads),
            "workload": {"requests": args.num_requests,
                         "mean_prompt_tokens": float(np.mean([len(p) for p, _ in warmup])),
                         "mean_output_tokens": float(np.mean([n for _, n in warmup]))}}


def served_model(base_url: str, api_key: str) -> str:
    request = urllib.request.Request(f"{base_url}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def engine_settings(args) -> dict:
    """The engine's settings, shared by the server and the offline LLM."""
    return {"block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len,
            "kv_cache_memory_bytes": int(args.kv_cache_mib * 2**20),
            "num_decode_steps": args.num_decode_steps, "async_scheduling": args.async_scheduling}


def server_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "jpaged", "serve", "--model", args.model, "--port", str(port),
            "--max-waiting", str(2 * args.num_requests), "--block-size", str(args.block_size),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len),
            "--kv-cache-memory-bytes", str(int(args.kv_cache_mib * 2**20))] + (
                ["--warmup"] if args.warmup else []) + (
                [] if args.num_decode_steps is None
                else ["--num-decode-steps", str(args.num_decode_steps)]) + (
                ["--async-scheduling"] if args.async_scheduling else [])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(base_url: str, server: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            with open(log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"the server exited ({server.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy within {SERVER_START_TIMEOUT_S} s")


def with_server(args, run) -> dict:
    """run(base_url) against a server subprocess started for it, stopped afterwards."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        server = subprocess.Popen(server_command(args, port), stdout=log, stderr=log)
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_until_healthy(base_url, server, log.name)
            progress(f"server up at {base_url}")
            return run(base_url)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2', a Hugging Face directory or a .gguf file")
    parser.add_argument("--base-url", default=None,
                        help="a running server (else one is started on --model)")
    parser.add_argument("--api-key", default="unused", help="the --base-url server's API key")
    parser.add_argument("--request-rates", default="1,2,4,inf",
                        help="requests per second, comma-separated; inf sends all at once")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per run")
    parser.add_argument("--overhead-runs", type=int, default=3,
                        help="HTTP / offline pairs for http_overhead_pct (after a warm-up pair)")
    parser.add_argument("--scale", type=float, default=0.25,
                        help="factor on ShareGPT-like lengths, to fit a CPU")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 16 requests, rates 4 and inf (flags given override)")
    parser.add_argument("--warmup", action="store_true",
                        help="compile every step shape in the server and the offline engine "
                        "before timing")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="also the workload's limit on prompt + output tokens")
    parser.add_argument("--kv-cache-mib", type=float, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-decode-steps", type=int, default=None,
                        help="the engine's num_decode_steps (default: the machine's)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine's async_scheduling")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(num_requests=16, request_rates="4,inf")
    args = parser.parse_args(argv)
    args.request_rates = [float(rate) for rate in args.request_rates.split(",")]
    if args.num_requests < 1 or args.overhead_runs < 1:
        parser.error(f"--num-requests and --overhead-runs must be >= 1, got "
                     f"{args.num_requests} and {args.overhead_runs}")
    if not all(rate > 0 for rate in args.request_rates):
        parser.error(f"every request rate must be > 0 (inf for all at once), got "
                     f"{args.request_rates}")
    return args


def new_serving_report(argv: list[str] | None = None) -> dict:
    """The report's common part, taken as the run starts (experiments.report)."""
    return new_report("benchmarks.serving", argv, peers=("fastapi", "uvicorn", "openai"))


def report(header: dict, args, measured: dict) -> dict:
    """The JSON report: `header` (new_serving_report), the settings, the measurements."""
    return header | {
        "settings": vars(args) | {"request_rates": [str(rate) for rate in args.request_rates],
                                  "dtype": "float32", "dataset": "sharegpt-like",
                                  "sampling": "greedy, ignore_eos"},
        **measured,
    }


def main(argv: list[str] | None = None) -> dict:
    from jpaged.entrypoints.llm import LLM

    args = parse_args(argv)
    header = new_serving_report(argv)

    def run(base_url: str) -> dict:
        llm = LLM(args.model, **engine_settings(args))
        if args.warmup:
            llm.engine.warmup()
        return measure(args, base_url, llm)

    measured = run(args.base_url) if args.base_url else with_server(args, run)
    result = report(header, args, measured)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
