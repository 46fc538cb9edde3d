"""The default model's matrix products in XLA against torch (oneDNN) on the same cores.

    python -m benchmarks.matmul [--rows 1 64 256]

SmolLM2-135M's products in float32, [rows, in] x [in, out] for the fused q/k/v
projection, the attention output, the fused gate/up projection, the down projection
and the tied vocabulary head, at the row counts of a batch-1 decode step, a 64-sequence
decode step and a 256-token prefill chunk. XLA's product runs jit-compiled; torch's
`matmul` on torch.get_num_threads() threads, set to the usable cores (XLA's CPU
threads span them too). XLA's and torch's turns alternate, and each figure is the
best of --repeats calls of a round, the better of two rounds. Also XLA's bfloat16
product with float32 results (what a bfloat16 model runs). Prints one JSON object
last: GFLOP/s and XLA's time over torch's per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.report import new_report, progress, record_end_load

# (in, out) of each product of a SmolLM2 layer, and of its tied vocabulary head.
SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072),
          "down_proj": (1536, 576), "lm_head": (576, 49152)}


def best_time(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def rates(rows: int, size: tuple[int, int], repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, size[0]), np.float32)
    w = rng.standard_normal(size, np.float32)
    product = jax.jit(lambda a, b: a @ b)
    bf16_product = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32))
    jx, jw = jnp.asarray(x), jnp.asarray(w)
    bx, bw = jx.astype(jnp.bfloat16), jw.astype(jnp.bfloat16)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    calls = {"xla": lambda: product(jx, jw).block_until_ready(),
             "torch": lambda: torch.matmul(tx, tw),
             "xla_bf16": lambda: bf16_product(bx, bw).block_until_ready()}
    seconds = {name: min(best_time(call, repeats) for _ in range(2))
               for name, call in calls.items()}
    gflop = 2 * rows * size[0] * size[1] / 1e9
    result = {f"{name}_gflop_per_s": gflop / s for name, s in seconds.items()}
    result["xla_time_over_torch"] = seconds["xla"] / seconds["torch"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    report = new_report("benchmarks.matmul", peers=("torch",))
    report["settings"] = vars(args) | {"torch_threads": torch.get_num_threads(),
                                       "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    report["products"] = {}
    for rows in args.rows:
        for name, size in SHAPES.items():
            result = rates(rows, size, args.repeats)
            report["products"][f"{name}@{rows}"] = result
            progress(f"{name} x {rows} rows: " + ", ".join(
                f"{key} {value:.2f}" for key, value in result.items()))
    record_end_load(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
