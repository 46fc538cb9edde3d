"""The default model's matrix products and attention in XLA against torch on the same cores.

    python -m benchmarks.matmul [--rows 1 64 256]

SmolLM2-135M's products in float32, [rows, in] x [in, out] for the fused q/k/v
projection, the attention output, the fused gate/up projection, the down projection
and the tied vocabulary head, at the row counts of a batch-1 decode step, a 64-sequence
decode step and a 256-token prefill chunk. XLA's product runs jit-compiled; torch's
`matmul` on torch.get_num_threads() threads, set to the usable cores (XLA's CPU
threads span them too). XLA's and torch's turns alternate, and each figure is the
best of --repeats calls of a round, the better of two rounds. Also XLA's bfloat16
product with float32 results (what a bfloat16 model runs).

Attention, one layer of SmolLM2 (9 query heads, 3 KV heads, head_dim 64) in float32
over a paged cache of 16-token blocks: a decode step of 64 sequences of mixed lengths
(the ShareGPT-like workload's contexts) and a 256-token prefill chunk at the end of a
2,048-token prompt. XLA runs the engine's own op (`kernels_pallas`, the "xla"
implementation); torch gathers the same pages through the same block tables
(`index_select`) and runs `scaled_dot_product_attention` with the same masks, its
gather included. Each reports its time, the K/V bytes the step reads and the rate,
with the largest difference between the two outputs.
Prints one JSON object last: GFLOP/s and XLA's time over torch's per shape, and the
attention figures.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments.report import call_seconds, new_report, progress, record_end_load

# (in, out) of each product of a SmolLM2 layer, and of its tied vocabulary head.
SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072),
          "down_proj": (1536, 576), "lm_head": (576, 49152)}


def best_time(call, repeats: int) -> float:
    return min(call_seconds(call, repeats))


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


ATTENTION = {"q_heads": 9, "kv_heads": 3, "head_dim": 64, "block_size": 16}


def attention_cases(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(context lengths, new tokens per sequence) of each attention case."""
    decode = rng.integers(20, 500, 64)
    return {"decode_64_seqs": (decode, np.ones(64, np.int64)),
            "prefill_256_at_2048": (np.array([2048]), np.array([256]))}


def attention_rates(context_lens: np.ndarray, q_lens: np.ndarray, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    import kernels_pallas

    heads, kv_heads, head_dim, block_size = ATTENTION.values()
    rng = np.random.default_rng(1)
    pages = -(-context_lens // block_size)
    num_blocks = int(pages.sum()) + 1
    width = int(pages.max())
    tables = np.zeros((len(pages), width), np.int32)
    ids = rng.permutation(num_blocks - 1) + 1  # block 0 is the null block
    for row, start in enumerate(np.cumsum(pages) - pages):
        tables[row, :pages[row]] = ids[start:start + pages[row]]
    k_pool, v_pool = (rng.standard_normal((kv_heads, num_blocks, block_size, head_dim),
                                          np.float32) for _ in range(2))
    num_tokens = int(q_lens.sum())
    q = rng.standard_normal((num_tokens, heads, head_dim), np.float32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    jq, jk, jv = jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool)
    args = (jnp.asarray(tables), jnp.asarray(context_lens, jnp.int32), jnp.asarray(starts))
    xla = jax.jit(lambda q, k, v, t, c, s: kernels_pallas.ragged_paged_attention(
        q, k, v, t, c, s, implementation="xla"))

    # torch: the sequences' pages gathered into [B, Hkv, width * block_size, D], then
    # one masked attention; each query sees the keys up to its own position.
    tk, tv = (torch.from_numpy(x.transpose(1, 0, 2, 3).copy()) for x in (k_pool, v_pool))
    flat_tables = torch.from_numpy(tables.reshape(-1).astype(np.int64))
    positions = np.full((len(pages), int(q_lens.max())), -1)
    for row, (length, new) in enumerate(zip(context_lens, q_lens, strict=True)):
        positions[row, :new] = np.arange(length - new, length)
    keys = np.arange(width * block_size)
    mask = torch.from_numpy((keys[None, None, :] <= positions[:, :, None])
                            & (positions[:, :, None] >= 0))[:, None]
    tq = torch.zeros(len(pages), heads, int(q_lens.max()), head_dim)
    for row in range(len(pages)):
        tq[row, :, :q_lens[row]] = torch.from_numpy(q[starts[row]:starts[row + 1]]).transpose(0, 1)

    def torch_attention():
        gathered = [pool.index_select(0, flat_tables).view(
            len(pages), width, kv_heads, block_size, head_dim).permute(0, 2, 1, 3, 4).reshape(
            len(pages), kv_heads, width * block_size, head_dim) for pool in (tk, tv)]
        return torch.nn.functional.scaled_dot_product_attention(
            tq, *gathered, attn_mask=mask, enable_gqa=True)

    xla_out, torch_out = np.asarray(xla(jq, jk, jv, *args)), torch_attention().numpy()
    difference = max(float(np.abs(xla_out[starts[row]:starts[row + 1]]
                                  - torch_out[row, :, :q_lens[row]].transpose(1, 0, 2)).max())
                     for row in range(len(pages)))
    calls = {"xla": lambda: xla(jq, jk, jv, *args).block_until_ready(),
             "torch": torch_attention}
    seconds = {name: min(best_time(call, repeats) for _ in range(2))
               for name, call in calls.items()}
    kv_bytes = 2 * int(pages.sum()) * kv_heads * block_size * head_dim * 4
    result = {f"{name}_ms": 1e3 * s for name, s in seconds.items()}
    result |= {f"{name}_kv_gb_per_s": kv_bytes / s / 1e9 for name, s in seconds.items()}
    result["kv_mib"] = kv_bytes / 2**20
    result["xla_time_over_torch"] = seconds["xla"] / seconds["torch"]
    result["max_abs_difference"] = difference
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
                                       "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                                       "attention": ATTENTION}
    report["products"] = {}
    for rows in args.rows:
        for name, size in SHAPES.items():
            result = rates(rows, size, args.repeats)
            report["products"][f"{name}@{rows}"] = result
            progress(f"{name} x {rows} rows: " + ", ".join(
                f"{key} {value:.2f}" for key, value in result.items()))
    report["attention"] = {}
    for name, (context_lens, q_lens) in attention_cases(np.random.default_rng(0)).items():
        result = attention_rates(context_lens, q_lens, args.repeats)
        report["attention"][name] = result
        progress(f"attention {name}: " + ", ".join(
            f"{key} {value:.2f}" for key, value in result.items()))
    record_end_load(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
