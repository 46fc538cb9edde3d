"""What a quantized KV cache costs in accuracy and buys in capacity, against float32.

    python -m benchmarks.kv_quant [--quick]

Accuracy, on SmolLM2-135M and Gemma 3 270M (their real weights, float32), for the
bfloat16, int8 and fp8 KV caches against the float32 cache:

- perplexity of a fixed English text that ships with Python (the standard
  library's `pydoc_data.topics`, its topics in sorted order; its sha256 is
  recorded, since it changes between Python versions), --text-tokens tokens
  teacher-forced through the paged engine in windows of max_model_len - 1 tokens,
  each token's log-probability from `prompt_logprobs`;
- the mean KL divergence KL(float32 || dtype) of the next-token distributions on
  that text: the engine's final hidden states of each teacher-forced token are kept
  as it computes its prompt log-probabilities, and both runs' full distributions come
  from the same weights;
- greedy agreement on --num-prompts passages of that text (every 64th topic line
  that starts a paragraph, 48 tokens each): the fraction of prompts whose
  --new-tokens tokens are identical, and the mean length of the matching prefix.

Targets: int8 within 1 % of float32's perplexity with at least 90 % of the prompts
identical; fp8_e4m3 within 2 %; fp8_e5m2 reported as measured.

Capacity and speed, on SmolLM2: at one --pool-mib KV pool, --num-requests
ShareGPT-like requests (lengths scaled by --length-scale) all at once, per dtype: the
most sequences running at once, their mean over the steps that left requests waiting,
and output tokens/s over the steps that compiled nothing. The peak is reached in the
first step, by as many of the first prompts as the pool holds, so it follows the
lengths of the first few dozen requests; the mean follows all of them.
max_num_seqs is the number of requests, and the defaults give more requests than
int8's pool holds at once, so memory binds every dtype, not the request count; the
step's token budget (--max-num-batched-tokens) admits a pool's worth of prompts in a
few steps, so that the admission rate does not bind either (with the CPU default of
256 tokens a step, early sequences grow while later ones are admitted, and the
running peak stays far below what the pool holds). Then the decode step
at equal batch: --decode-batch requests of --decode-context prompt tokens run
on one engine per dtype, stepped in turn (alternating, so load changes hit all
alike), timing the steps in which every sequence decodes: the dequantization's cost
is int8's step time over float32's. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np

from benchmarks.all_at_once import decoding, serve
from experiments.report import new_report, progress, record_end_load
from experiments.workloads import sample_lengths

# bfloat16, the 2-byte cache, is the yardstick for the 1-byte ones' accuracy.
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")
CAPACITY_DTYPES = ("float32", "bfloat16", "int8")
PERPLEXITY_TARGETS = {"int8": 0.01, "fp8_e4m3": 0.02}
AGREEMENT_TARGET = {"int8": 0.9}
# Hidden-state rows per logits call (one compiled shape).
LOGIT_ROWS = 256


def reference_text() -> tuple[str, str]:
    """(the text, its sha256): pydoc's topics, sorted by name, blank lines between."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return text, hashlib.sha256(text.encode()).hexdigest()


def passages(text: str, tokenizer, num: int, length: int) -> list[list[int]]:
    """num prompts of `length` tokens, each starting at a paragraph spread over the text."""
    starts = [i + 2 for i in range(len(text) - 2) if text[i:i + 2] == "\n\n"]
    chosen = starts[:: max(1, len(starts) // num)][:num]
    return [tokenizer.encode(text[s:s + 8 * length], add_special_tokens=False)[:length]
            for s in chosen]


def engine(name: str, loaded, kv_cache_dtype: str, **options):
    from jpaged import LLM

    return LLM(name, loaded=loaded, kv_cache_dtype=kv_cache_dtype, dtype="float32",
               enable_prefix_caching=False, **options)


def teacher_forced(llm, windows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(the log-probability of every token after each window's first, f32 [N]; the final
    hidden states that predicted them, [N, hidden]) through the engine's prompt_logprobs."""
    from jpaged import SamplingParams

    runner, kept = llm.engine.runner, []
    computes = runner.token_logprobs

    def keeping(hidden, targets, num_top):
        kept.append(np.asarray(hidden)[np.flatnonzero(targets)])
        return computes(hidden, targets, num_top)

    runner.token_logprobs = keeping
    logprobs = []
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    try:
        for window in windows:
            (output,) = llm.generate([{"prompt_token_ids": window}], params)
            logprobs += [entry[token].logprob for token, entry in
                         zip(window[1:], output.prompt_logprobs[1:], strict=True)]
    finally:
        runner.token_logprobs = computes
    hidden = np.concatenate(kept)
    if len(hidden) != len(logprobs):
        raise RuntimeError(f"kept {len(hidden)} hidden states for {len(logprobs)} tokens "
                           "(a target token id 0 in the text?)")
    return np.asarray(logprobs, np.float32), hidden


def log_softmax_rows(runner, hidden: np.ndarray) -> np.ndarray:
    """Full next-token log-distributions f32 [N, vocab] of final hidden states [N, hidden]."""
    import jax

    out = []
    for start in range(0, len(hidden), LOGIT_ROWS):
        rows = hidden[start:start + LOGIT_ROWS]
        padded = np.zeros((LOGIT_ROWS, hidden.shape[1]), hidden.dtype)
        padded[:len(rows)] = rows
        logits = runner.logits(padded, LOGIT_ROWS)
        out.append(np.asarray(jax.nn.log_softmax(logits, axis=-1))[:len(rows)])
    return np.concatenate(out)


def mean_kl(runner, reference_hidden: np.ndarray, hidden: np.ndarray) -> float:
    """Mean over tokens of KL(P || Q), P from reference_hidden and Q from hidden."""
    total = 0.0
    for start in range(0, len(hidden), 4 * LOGIT_ROWS):
        stop = start + 4 * LOGIT_ROWS
        log_p = log_softmax_rows(runner, reference_hidden[start:stop])
        log_q = log_softmax_rows(runner, hidden[start:stop])
        total += float((np.exp(log_p) * (log_p - log_q)).sum())
    return total / len(hidden)


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    prefixes = []
    for want, have in zip(reference, tokens, strict=True):
        matching = next((i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b),
                        len(want))
        prefixes.append(matching)
    return {"identical_fraction": float(np.mean([p == len(r) for p, r in
                                                 zip(prefixes, reference, strict=True)])),
            "mean_matching_prefix": float(np.mean(prefixes))}


def accuracy(name: str, args, text: str) -> dict:
    """Perplexity, KL and greedy agreement of every KV dtype against float32's cache."""
    from jpaged.model.loader import load_model

    loaded = load_model(name)
    tokenizer = loaded[2]
    tokens = tokenizer.encode(text, add_special_tokens=False)[: args.text_tokens]
    window = args.max_model_len - 1
    windows = [tokens[i:i + window] for i in range(0, len(tokens), window)]
    windows = [w for w in windows if len(w) > 1]
    prompts = passages(text, tokenizer, args.num_prompts, 48)
    result: dict = {"text_tokens": len(tokens), "window_tokens": window,
                    "num_prompts": len(prompts), "new_tokens": args.new_tokens, "kv": {}}
    reference = None
    for kv_cache_dtype in KV_DTYPES:
        progress(f"{name}: {kv_cache_dtype} cache...")
        llm = engine(name, loaded, kv_cache_dtype, max_model_len=args.max_model_len,
                     max_num_seqs=max(args.num_prompts, 1))
        started = time.perf_counter()
        logprobs, hidden = teacher_forced(llm, windows)
        tokens_out = greedy(llm, prompts, args.new_tokens)
        run = {"perplexity": float(np.exp(-logprobs.mean())),
               "kv_cache": str(llm.engine.kv_cache_info),
               "wall_s": time.perf_counter() - started}
        if reference is None:
            reference = {"hidden": hidden, "tokens": tokens_out, "runner": llm.engine.runner,
                         "perplexity": run["perplexity"]}
        else:
            run["perplexity_change"] = run["perplexity"] / reference["perplexity"] - 1
            run["mean_kl"] = mean_kl(reference["runner"], reference["hidden"], hidden)
            run |= agreement(reference["tokens"], tokens_out)
            run |= targets_met(kv_cache_dtype, run)
        progress(f"  {json.dumps(run)}")
        result["kv"][kv_cache_dtype] = run
        if kv_cache_dtype != "float32":
            del llm
    return result


def targets_met(kv_cache_dtype: str, run: dict) -> dict:
    met = {}
    if kv_cache_dtype in PERPLEXITY_TARGETS:
        met["perplexity_target_met"] = (abs(run["perplexity_change"])
                                        <= PERPLEXITY_TARGETS[kv_cache_dtype])
    if kv_cache_dtype in AGREEMENT_TARGET:
        met["agreement_target_met"] = (run["identical_fraction"]
                                       >= AGREEMENT_TARGET[kv_cache_dtype])
    return met


def capacity(args, loaded) -> dict:
    """The most sequences each dtype runs at once in one pool (and the mean while the pool
    binds), and its output tokens/s."""
    rng = np.random.default_rng(args.seed)
    lengths = np.maximum(4, (sample_lengths("sharegpt", args.num_requests, rng)
                             * args.length_scale).astype(int))
    vocab = loaded[1].vocab_size
    requests = [(rng.integers(3, vocab, int(p)).tolist(), int(o)) for p, o in lengths]
    result = {"pool_bytes": args.pool_mib * 2**20, "num_requests": len(requests),
              "mean_prompt_len": float(lengths[:, 0].mean()),
              "mean_output_len": float(lengths[:, 1].mean()), "kv": {}}
    max_len = int(lengths.sum(axis=1).max())
    for kv_cache_dtype in CAPACITY_DTYPES:
        progress(f"capacity: {kv_cache_dtype} cache...")
        llm = engine("smollm2", loaded, kv_cache_dtype, kv_cache_memory_bytes=args.pool_mib * 2**20,
                     max_num_seqs=len(requests), max_model_len=max_len,
                     max_num_batched_tokens=args.max_num_batched_tokens)
        result["kv"][kv_cache_dtype] = serve(llm, requests)
        progress(f"  {json.dumps(result['kv'][kv_cache_dtype])}")
        del llm
    runs = result["kv"]
    for measure in ("running_peak", "running_mean_while_waiting"):
        for peer in ("float32", "bfloat16"):
            result[f"{measure}_ratio_int8_vs_{peer}"] = (runs["int8"][measure]
                                                         / runs[peer][measure])
    return result


def decode_step_times(args, loaded) -> dict:
    """Median decode step time of each dtype at one batch and context, stepped in turn."""
    from jpaged import SamplingParams
    from jpaged.engine.stats import num_compilations

    rng = np.random.default_rng(args.seed + 1)
    vocab = loaded[1].vocab_size
    prompts = [rng.integers(3, vocab, args.decode_context).tolist()
               for _ in range(args.decode_batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True)
    engines = {}
    for kv_cache_dtype in CAPACITY_DTYPES:
        llm = engine("smollm2", loaded, kv_cache_dtype, max_num_seqs=args.decode_batch,
                     max_model_len=args.decode_context + args.decode_steps)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(str(i), prompt, params)
        engines[kv_cache_dtype] = llm.engine
    times: dict[str, list[float]] = {dtype: [] for dtype in engines}
    while any(core.has_unfinished_requests() for core in engines.values()):
        for kv_cache_dtype, core in engines.items():
            if not core.has_unfinished_requests():
                continue
            timed = decoding(core) and core.scheduler.num_running == args.decode_batch
            compiled, started = num_compilations(), time.perf_counter()
            core.step()
            elapsed = time.perf_counter() - started
            if timed and num_compilations() == compiled:
                times[kv_cache_dtype].append(elapsed)
    medians = {dtype: float(np.median(t)) if t else None for dtype, t in times.items()}
    return {"batch": args.decode_batch, "context": args.decode_context,
            "steps_timed": {dtype: len(t) for dtype, t in times.items()},
            "median_step_s": medians,
            "step_time_ratio_vs_float32": {dtype: m / medians["float32"]
                                           for dtype, m in medians.items()
                                           if m is not None and medians["float32"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--pool-mib", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--length-scale", type=float, default=0.25)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the capacity runs' token budget per step")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a short check: fewer tokens, prompts and requests")
    args = parser.parse_args()
    if args.quick:
        args.text_tokens, args.max_model_len, args.num_prompts = 1024, 512, 8
        args.new_tokens, args.num_requests, args.pool_mib = 16, 96, 16
        args.length_scale = 0.1
        args.decode_batch, args.decode_context, args.decode_steps = 4, 128, 16
    report = new_report("benchmarks.kv_quant")
    report["settings"] = vars(args)
    text, sha256 = reference_text()
    report["text"] = {"source": "pydoc_data.topics, sorted by topic", "sha256": sha256,
                      "characters": len(text)}
    report["accuracy"] = {name: accuracy(name, args, text) for name in args.models.split(",")}

    from jpaged.model.loader import load_model

    loaded = load_model("smollm2")
    report["capacity"] = capacity(args, loaded)
    report["decode_step"] = decode_step_times(args, loaded)
    record_end_load(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
