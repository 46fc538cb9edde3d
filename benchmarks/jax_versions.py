"""The same tree under two interpreters (two jax versions): the XLA attention loop, a
loop of small in-place writes, and the engine's decode loop.

    python -m benchmarks.jax_versions --other-python PYTHON [--rounds N] [--quick]

Side A is the interpreter running this script, side B `--other-python` (another
virtual environment's python, with its own jax). Each round starts one worker process
per side, A then B, so the two sides meet the machine's load in turns (A B A B ...);
a worker imports this tree (the working directory), compiles every workload once,
then times it and prints its medians as one JSON line. The figures, all in
milliseconds (lower is better):

    xla_decode_64_ms        paged decode attention, implementation "xla", 64 sequences
                            of 20-500 cached tokens (SmolLM2's 9 query / 3 KV heads of
                            64, blocks of 16), one layer
    xla_mixed_step_ms       ragged paged attention, implementation "xla": 48 decodes
                            beside a 256-token chunk at a 1,024-token context and a
                            64-token prompt, one layer
    small_writes_ms         a fori_loop of 64 one-row dynamic_update_slice writes into a
                            64 MiB buffer: jax issue 40101 (jaxlib 0.11.1) made each such
                            write rewrite the whole buffer on CPU
    decode_loop_ms_per_token the engine's decode loop (num_decode_steps 16) on a tiny
                            random Llama (benchmarks.decode_loop's), 8 requests of 32
                            prompt tokens and 64 new tokens, prefix caching off: wall ms
                            per output token, prompts included

Per side, the median over rounds of each worker's median; B/A is B's median over A's
(above 1: B is slower). One JSON object last; progress on stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

import numpy as np

from experiments.report import REPO, call_seconds, new_report, progress, record_end_load, versions

# SmolLM2-135M's attention (benchmarks.matmul's ATTENTION).
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DECODE_ROWS, MIXED_DECODE_ROWS = 64, 48
# (new tokens, context) of the mixed step's prompt chunks, after its decodes.
MIXED_CHUNKS = ((256, 1024), (64, 64))
SMALL_WRITES, BUFFER_ROWS, ROW = 64, 4096, 4096
LOOP_STEPS, LOOP_BATCH, PROMPT_TOKENS, NEW_TOKENS = 16, 8, 32, 64
FIGURES = ("xla_decode_64_ms", "xla_mixed_step_ms", "small_writes_ms",
           "decode_loop_ms_per_token")
WORKER_TIMEOUT_S = 900


def median_ms(call, repeats: int) -> float:
    """Median wall milliseconds of call() (which waits for its result), after one call
    that compiles."""
    return 1e3 * statistics.median(call_seconds(call, repeats))


def paged_pool(context_lens: np.ndarray, rng: np.random.Generator):
    """(k, v pools [Hkv, N, bs, D] f32, block tables int32 [B, M]) holding each sequence's
    context in blocks of a random permutation of the pool (block 0: the null block)."""
    pages = -(-context_lens // BLOCK_SIZE)
    num_blocks = int(pages.sum()) + 1
    tables = np.zeros((len(pages), int(pages.max())), np.int32)
    ids = rng.permutation(num_blocks - 1) + 1
    for row, start in enumerate(np.cumsum(pages) - pages):
        tables[row, : pages[row]] = ids[start : start + pages[row]]
    k, v = (rng.standard_normal((KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM), np.float32)
            for _ in range(2))
    return k, v, tables


def xla_decode_ms(repeats: int) -> float:
    import jax

    import kernels_pallas

    rng = np.random.default_rng(0)
    context_lens = rng.integers(20, 500, DECODE_ROWS).astype(np.int32)
    k, v, tables = paged_pool(context_lens, rng)
    q = rng.standard_normal((DECODE_ROWS, Q_HEADS, HEAD_DIM), np.float32)
    decode = jax.jit(lambda *args: kernels_pallas.paged_decode_attention(
        *args, implementation="xla"))
    args = jax.device_put((q, k, v, tables, context_lens))
    return median_ms(lambda: decode(*args).block_until_ready(), repeats)


def xla_mixed_ms(repeats: int) -> float:
    import jax

    import kernels_pallas

    rng = np.random.default_rng(1)
    decode_lens = rng.integers(20, 500, MIXED_DECODE_ROWS)
    q_lens = np.concatenate([np.ones(MIXED_DECODE_ROWS, np.int64),
                             [new for new, _ in MIXED_CHUNKS]])
    context_lens = np.concatenate([decode_lens, [ctx for _, ctx in MIXED_CHUNKS]]).astype(
        np.int32)
    k, v, tables = paged_pool(context_lens, rng)
    q = rng.standard_normal((int(q_lens.sum()), Q_HEADS, HEAD_DIM), np.float32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ragged = jax.jit(lambda *args: kernels_pallas.ragged_paged_attention(
        *args, implementation="xla"))
    args = jax.device_put((q, k, v, tables, context_lens, starts))
    return median_ms(lambda: ragged(*args).block_until_ready(), repeats)


def small_writes_ms(repeats: int) -> float:
    """A loop of one-row writes into a donated buffer, as the decode loop and the XLA
    attention's state updates are: microseconds unless each write copies the buffer."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, donate_argnums=0)
    def write_rows(buffer, rows):
        def body(i, buffer):
            return jax.lax.dynamic_update_slice(buffer, rows[i][None], (i * 61, 0))
        return jax.lax.fori_loop(0, SMALL_WRITES, body, buffer)

    # The buffer is donated and taken back each call, so no call copies it up front.
    state = [jnp.zeros((BUFFER_ROWS, ROW), jnp.float32)]
    rows = jnp.ones((SMALL_WRITES, ROW), jnp.float32)

    def call():
        state[0] = write_rows(state[0], rows).block_until_ready()

    return median_ms(call, repeats)


def decode_loop_ms_per_token(repeats: int) -> float:
    from benchmarks.decode_loop import load
    from jpaged import LLM, SamplingParams

    loaded = load("tiny")
    # No prefix caching: a cached prompt would make every run after the first another
    # workload, with shapes the warm-up did not compile.
    llm = LLM("decode loop", loaded=loaded, num_decode_steps=LOOP_STEPS,
              max_num_seqs=LOOP_BATCH, max_model_len=PROMPT_TOKENS + NEW_TOKENS,
              block_size=16, enable_prefix_caching=False, persistent_compilation_cache=False)
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": p} for p in rng.integers(
        0, loaded[1].vocab_size, (LOOP_BATCH, PROMPT_TOKENS)).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ms = median_ms(lambda: llm.generate(prompts, params, use_tqdm=False), repeats)
    return ms / (LOOP_BATCH * NEW_TOKENS)


def worker(repeats: int) -> dict:
    """This interpreter's medians, its versions and its backend."""
    import jax

    figures = {"xla_decode_64_ms": xla_decode_ms(repeats),
               "xla_mixed_step_ms": xla_mixed_ms(repeats),
               "small_writes_ms": small_writes_ms(repeats),
               "decode_loop_ms_per_token": decode_loop_ms_per_token(max(2, repeats // 4))}
    return {"versions": versions(), "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "figures": figures}


def run_worker(python: str, repeats: int) -> dict:
    """One worker process of `python` on this tree -> its JSON line."""
    done = subprocess.run(
        [python, "-m", "benchmarks.jax_versions", "--worker", "--repeats", str(repeats)],
        cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
        env=os.environ | {"PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise RuntimeError(f"the worker of {python} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per figure: each side's median over its workers, their runs, and B/A."""
    results = {}
    for figure in FIGURES:
        samples = {side: [run["figures"][figure] for run in side_runs]
                   for side, side_runs in runs.items()}
        a, b = (statistics.median(samples[side]) for side in ("A", "B"))
        results[figure] = {"A": a, "B": b, "B_over_A": b / a,
                           "A_runs": samples["A"], "B_runs": samples["B"]}
    return results


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other-python", help="side B's interpreter (side A: this one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed calls per figure in a worker (a quarter of them, at "
                        "least 2, for the engine)")
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 4 repeats (a check, not a figure)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.repeats)))
        return None
    if not args.other_python:
        parser.error("--other-python is required: side B's interpreter")
    rounds, repeats = (1, 4) if args.quick else (args.rounds, args.repeats)
    report = new_report("benchmarks.jax_versions", argv)
    report["settings"] = {
        "rounds": rounds, "repeats": repeats, "order": "A then B in every round",
        "attention": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK_SIZE, "decode_rows": DECODE_ROWS,
                      "mixed_decode_rows": MIXED_DECODE_ROWS,
                      "mixed_chunks_new_and_context": MIXED_CHUNKS},
        "small_writes": {"writes": SMALL_WRITES, "buffer": [BUFFER_ROWS, ROW]},
        "decode_loop": {"num_decode_steps": LOOP_STEPS, "batch": LOOP_BATCH,
                        "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS}}
    pythons = {"A": sys.executable, "B": args.other_python}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for round_ in range(rounds):
        for side, python in pythons.items():
            progress(f"round {round_ + 1}/{rounds}: side {side}")
            runs[side].append(run_worker(python, repeats))
            progress(f"  {runs[side][-1]['figures']}")
    report["sides"] = {side: {key: side_runs[0][key]
                              for key in ("versions", "backend", "device")}
                       for side, side_runs in runs.items()}
    report["results"] = compare(runs)
    record_end_load(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
