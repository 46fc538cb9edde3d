"""What freeing a sliding window's KV blocks saves and buys, against keeping every block.

    python -m benchmarks.sliding_window [--quick]

Two models: Gemma 3 270M (its real weights; 3 global and 15 sliding layers, window
512: six KV cache groups of three layers) and a tiny random Mistral-shaped model whose
every layer slides (window --mistral-window; one group). Two workloads each, all
requests arriving at once, greedy, every output run to its length (ignore_eos):

- long: --num-long requests of --long-len random prompt tokens and --long-output
  output tokens (max_model_len set to fit them). A prompt takes about
  long_len / max_num_batched_tokens steps to prefill, one after another, so a
  sequence must decode for several of those prefills before the pool, not the
  schedule, bounds how many run at once: the default output is long enough for
  a dozen;
- sharegpt: --num-sharegpt requests of experiments.workloads' ShareGPT-like lengths.

Each (model, workload) runs twice on one KV pool of fixed bytes, --pool-seqs long
sequences with every block kept: with the window's blocks freed, and with
`disable_hybrid_kv_cache_manager=True` (every block kept). Reported per run:

- kv_bytes_per_seq: the pool bytes its tables hold per running sequence, the mean
  over the steps in which every running sequence decodes;
- running_peak: the most sequences running at once;
- output_tokens_per_s: output tokens over the wall time of the steps that compiled
  nothing (the first steps of each new shape compile; both runs compile alike);
- preemptions;

and the ratios freeing / keeping. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.all_at_once import serve
from experiments.report import new_report, progress, record_end_load
from experiments.workloads import sample_lengths

BLOCK_SIZE = 16
DTYPE, ITEMSIZE = "float32", 4
MAX_SHAREGPT_LEN = 2048


def long_requests(num: int, prompt_len: int, output_len: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, prompt_len).tolist(), output_len) for _ in range(num)]


def sharegpt_requests(num: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    lengths = sample_lengths("sharegpt", num, rng)
    return [(rng.integers(0, vocab, int(p)).tolist(), int(o)) for p, o in lengths]


def compare(name: str, loaded, requests, pool_bytes: int, max_model_len: int, args) -> dict:
    """The workload with the window's blocks freed and with every block kept."""
    from jpaged import LLM

    runs = {}
    for mode, keep in (("freeing", False), ("keeping", True)):
        progress(f"{name}: {mode} every block..." if keep else f"{name}: {mode} the window...")
        llm = LLM(name, loaded=loaded, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory_bytes=pool_bytes, enable_prefix_caching=False, dtype=DTYPE,
                  disable_hybrid_kv_cache_manager=keep)
        runs[mode] = serve(llm, requests)
        progress(f"  {json.dumps(runs[mode])}")
        del llm
    freeing, keeping = runs["freeing"], runs["keeping"]
    runs["ratios"] = {
        "kv_bytes_per_seq": _ratio(keeping["kv_bytes_per_seq"], freeing["kv_bytes_per_seq"]),
        "running_peak": _ratio(freeing["running_peak"], keeping["running_peak"]),
        "output_tokens_per_s": _ratio(freeing["output_tokens_per_s"],
                                      keeping["output_tokens_per_s"]),
    }
    return runs


def _ratio(a, b):
    return a / b if a is not None and b else None


def kept_sequence_bytes(model_config, num_tokens: int) -> int:
    """Bytes of one sequence's KV with every block of every layer kept."""
    blocks = -(-num_tokens // BLOCK_SIZE)
    return (2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
            * ITEMSIZE * BLOCK_SIZE * blocks)


def tiny_mistral(window: int, max_len: int):
    """(model, config, tokenizer): random weights, every layer sliding by `window`; the
    default model's tokenizer (its vocabulary) for the detokenizer."""
    from flax import nnx

    from jpaged.model.config import LlamaConfig
    from jpaged.model.llama import LlamaForCausalLM
    from jpaged.model.loader import load_model

    _, default_config, tokenizer = load_model("smollm2")
    config = LlamaConfig(vocab_size=default_config.vocab_size, hidden_size=128,
                         intermediate_size=256, num_layers=8, num_heads=4, num_kv_heads=2,
                         head_dim=32,
                         max_position_embeddings=max_len, sliding_window=window,
                         eos_token_ids=default_config.eos_token_ids)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0)), config, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-long", type=int, default=14)
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--long-output", type=int, default=96)
    parser.add_argument("--num-sharegpt", type=int, default=32)
    parser.add_argument("--pool-seqs", type=int, default=4,
                        help="the KV pool: this many long sequences with every block kept")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--mistral-window", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a short check: 1,024-token long requests, fewer of each")
    args = parser.parse_args()
    if args.quick:
        args.num_long, args.long_len, args.num_sharegpt = 6, 1024, 8
    report = new_report("benchmarks.sliding_window")
    report["settings"] = vars(args) | {"block_size": BLOCK_SIZE}

    from jpaged.model.loader import load_model

    long_len = args.long_len + args.long_output
    models = {"gemma3": load_model("gemma3"),
              "tiny_mistral": tiny_mistral(args.mistral_window, max(long_len, MAX_SHAREGPT_LEN))}
    for name, loaded in models.items():
        config, vocab = loaded[1], loaded[1].vocab_size
        pool_bytes = args.pool_seqs * kept_sequence_bytes(config, long_len)
        report[name] = {
            "layer_windows": list(config.layer_windows),
            "pool_bytes": pool_bytes,
            "long": compare(name, loaded,
                            long_requests(args.num_long, args.long_len, args.long_output, vocab,
                                          args.seed),
                            pool_bytes, long_len, args),
            "sharegpt": compare(name, loaded, sharegpt_requests(args.num_sharegpt, vocab,
                                                                args.seed),
                                pool_bytes, MAX_SHAREGPT_LEN, args),
        }
    record_end_load(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
