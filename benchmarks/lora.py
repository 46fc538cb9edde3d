"""Multi-LoRA serving: output tokens per second with 1, 8 and 64 distinct adapters across
concurrent requests against the base model alone on an engine without LoRA (S-LoRA's
shape of result), with the adapter loads the slots took and their time; `--products`
measures the grouped low-rank product of a step (jpaged.model.llama.lora_delta, a masked
batched product) against lax.ragged_dot over tokens sorted by slot and a per-token
gather of the factors.

    python -m benchmarks.lora                 # SmolLM2, 64 requests, max_loras=8, rank 16
    python -m benchmarks.lora --quick         # fewer, shorter requests
    python -m benchmarks.lora --products      # the product alone

Adapters are random rank-16 PEFT adapters of every projection, written to a temporary
directory in PEFT's format. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from experiments.report import new_report, record_end_load

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every projection of `config`'s model."""
    from jpaged.lora.peft import projection_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name, (out, inp) in projection_shapes(config).items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, inp)) /
                                                  np.sqrt(inp)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (0.02 * rng.standard_normal((out, rank))
                                                  ).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
         "bias": "none"}))
    return directory


def serve_case(llm, prompts, params, loras) -> dict:
    """Run every prompt at once; tokens per second and the loads the slots took."""
    table, runner = llm.engine.adapters, llm.engine.runner
    seconds = [0.0]
    load = runner.load_adapters

    def timed_load(loads):
        start = time.perf_counter()
        load(loads)
        jax.block_until_ready(runner._param_leaves)
        seconds[0] += time.perf_counter() - start

    runner.load_adapters = timed_load
    loads_before = 0 if table is None else table.num_loads
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=list(loras))
    elapsed = time.perf_counter() - start
    runner.load_adapters = load
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": round(elapsed, 3),
            "output_tokens_per_s": round(tokens / elapsed, 2),
            "adapter_loads": 0 if table is None else table.num_loads - loads_before,
            "adapter_load_seconds": round(seconds[0], 4)}


def engine_cases(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="jpaged-lora-") as adapters:
        return measure_engines(args, Path(adapters))


def measure_engines(args, root: Path) -> dict:
    """Rows: the base model alone on an engine without LoRA (S-LoRA's baseline: no slots,
    no low-rank products, the KV pool the whole budget), the base model's requests on the
    LoRA engine, then each number of distinct adapters. The rows run in turn, `--rounds`
    times over (this machine's other work comes and goes); each keeps its fastest round,
    and its throughput over the first row's."""
    from jpaged import LLM, LoRARequest, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 10000, args.prompt_len).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    # Every run prefills its prompts: a prefix cache would serve a row the prompts an
    # earlier run of its engine left (the base model alone's always, the LoRA engine's
    # rows only those of the same adapter).
    engine = dict(num_decode_steps=1, max_num_seqs=args.requests, enable_prefix_caching=False)
    alone = LLM(args.model, **engine)
    llm = LLM(args.model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
              max_cpu_loras=max(args.adapters), **engine)
    config = llm.engine.model_config
    requests = [LoRARequest(f"adapter{i}", i + 1, str(write_adapter(root / str(i), config,
                                                                     args.rank, i)))
                for i in range(max(args.adapters))]
    nones = [None] * args.requests
    rows = {"base_model_alone": (alone, nones), "base_on_lora_engine": (llm, nones)}
    for distinct in args.adapters:
        rows[f"{distinct}_adapters"] = (llm, [requests[i % distinct]
                                              for i in range(args.requests)])
    # Compile the step shapes and the slot write once, outside the measured runs.
    serve_case(alone, prompts, params, nones)
    serve_case(llm, prompts, params, [requests[-1]] * args.requests)
    rounds = [{name: serve_case(engine, prompts, params, loras)
               for name, (engine, loras) in rows.items()} for _ in range(args.rounds)]
    cases = {}
    for name in rows:
        runs = [measured[name] for measured in rounds]
        cases[name] = max(runs, key=lambda run: run["output_tokens_per_s"]) | {
            "rounds_output_tokens_per_s": [run["output_tokens_per_s"] for run in runs],
            "rounds_adapter_loads": [run["adapter_loads"] for run in runs]}
    base = cases["base_model_alone"]["output_tokens_per_s"]
    for case in cases.values():
        case["vs_base_model_alone"] = round(case["output_tokens_per_s"] / base, 3)
    return {"kv_cache": str(llm.engine.kv_cache_info),
            "kv_cache_base_model_alone": str(alone.engine.kv_cache_info),
            "adapter_slot_bytes": llm.engine.kv_cache_info.adapter_bytes, "cases": cases}


def products(args) -> dict:
    """Seconds per call of three ways to apply S slots' factors to T tokens."""
    from jpaged.model.llama import lora_delta

    t, d_in, d_out, r, s = args.tokens, 576, 960, 3 * args.rank, args.max_loras
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, d_in)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((s, d_in, r)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((s, r, d_out)), jnp.float32)
    slots = jnp.asarray(np.sort(rng.integers(0, s + 1, t)), jnp.int32)

    def ragged(x, a, b, slots):
        zero_a = jnp.concatenate([jnp.zeros_like(a[:1]), a])
        zero_b = jnp.concatenate([jnp.zeros_like(b[:1]), b])
        order = jnp.argsort(slots)
        sizes = jnp.bincount(slots, length=s + 1).astype(jnp.int32)
        down = jax.lax.ragged_dot(x[order], zero_a, sizes)
        up = jax.lax.ragged_dot(down, zero_b, sizes)
        return jnp.zeros_like(up).at[order].set(up)

    def gather(x, a, b, slots):
        zero_a = jnp.concatenate([jnp.zeros_like(a[:1]), a])
        zero_b = jnp.concatenate([jnp.zeros_like(b[:1]), b])
        down = jnp.einsum("ti,tir->tr", x, zero_a[slots])
        return jnp.einsum("tr,tro->to", down, zero_b[slots])

    reference = np.asarray(lora_delta(x, a, b, slots))
    timings = {}
    for name, fn in (("masked", lora_delta), ("ragged_dot", ragged), ("gather", gather)):
        compiled = jax.jit(fn)
        np.testing.assert_allclose(np.asarray(compiled(x, a, b, slots)), reference,
                                   rtol=2e-3, atol=2e-3)
        compiled(x, a, b, slots).block_until_ready()
        start = time.perf_counter()
        for _ in range(args.repeats):
            compiled(x, a, b, slots).block_until_ready()
        timings[name] = round((time.perf_counter() - start) / args.repeats * 1e3, 4)
    return {"shape": {"tokens": t, "in": d_in, "out": d_out, "rank": r, "slots": s},
            "ms_per_call": timings, "backend": jax.default_backend()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="16 requests of 16 + 8 tokens")
    parser.add_argument("--products", action="store_true", help="the low-rank product only")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of --products")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every row, in turn")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.output_len = 16, 16, 8
        args.adapters = [1, 8, 16]
    report = new_report("benchmarks.lora")
    report["settings"] = {k: v for k, v in vars(args).items()}
    report["products"] = products(args)
    if not args.products:
        report |= engine_cases(args)
    record_end_load(report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
