"""Speculative decoding on the default model: n-gram and draft-model proposals against
decoding one token per step, and against transformers' assisted generation.

    python -m benchmarks.speculative [--rounds N] [--max-tokens T] [--k K]
                                     [--draft-layers L] [--quick]

Two workloads of chat prompts through the model's chat template, greedy, T new tokens
each (ignore_eos, so every system generates the same count):

- repetitive: the model is asked to repeat or lightly edit a passage of the standard
  library's documentation or of its source code, which the prompt holds: the output
  repeats the prompt, where n-grams find proposals;
- ordinary: questions on everyday topics, where they rarely do.

Systems, each on the same prompts: jpaged's `LLM` without speculation, with n-gram
proposals (k tokens, the default prompt lookup bounds), and with a draft model (the default model
cut to its first L layers, with its final norm and LM head: written by transformers
into the cache once; no other model with its 49,152-token vocabulary installs without
network); transformers' `generate`, with prompt lookup (`prompt_lookup_num_tokens=k`)
and with the same draft as assistant (`assistant_model`). Batch 1 runs the prompts one
after the other; batch 8 submits them at once to jpaged (transformers' assisted
generation takes one sequence at a time, so it has no batch-8 figure). The systems
alternate within each of --rounds rounds; each figure is the median over rounds of
output tokens/s. jpaged's engines are warmed up first (`warmup()`), transformers with
one short generation each.

Reported: tokens/s, the ratios to jpaged without speculation and to transformers,
acceptance (`EngineStats.spec_decode` over each measured run), whether greedy outputs
equal jpaged's without speculation, the targets (n-gram at least 1.8x at batch 1 on
the repetitive prompts and at least 0.95x on the ordinary ones), and what a
verification costs: the model step of one sequence at a 512-token context with 1
token (a decode step) and with 1 + k (a verifying step), alternating, and the
matrix products of those steps alone (the layers' weights times 1 and 1 + k rows).
One JSON object last.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import pydoc_data.topics
import statistics
import textwrap
import time
from pathlib import Path

from experiments.report import new_report, progress, record_end_load
from jpaged.speculative.config import DEFAULT_LOOKUP_MAX as LOOKUP_MAX
from jpaged.speculative.config import DEFAULT_LOOKUP_MIN as LOOKUP_MIN

TOPICS = ["the moon", "rivers", "bread", "volcanoes", "chess", "honey bees", "glass",
          "rain"]
BATCHES = (1, 8)


def repetitive_prompts(count: int) -> list[str]:
    """Requests to repeat or edit text the prompt holds: documentation passages and
    functions of the standard library, both shipped with Python."""
    topics = pydoc_data.topics.topics
    passages = [" ".join(topics[name].split()[:120]) for name in sorted(topics)[5:5 + count]]
    sources = [textwrap.dedent(inspect.getsource(function)) for function in (
        textwrap.dedent, textwrap.indent, json.dumps, statistics.median, statistics.mode,
        inspect.getdoc, Path.with_suffix, textwrap.shorten)]
    requests = []
    for i in range(count):
        if i % 2:
            requests.append("Repeat the following function exactly, with `text` renamed to "
                            f"`value` wherever it appears:\n\n{sources[i % len(sources)]}")
        else:
            requests.append("Repeat the following passage word for word:\n\n"
                            f"{passages[i % len(passages)]}")
    return requests


def ordinary_prompts(count: int) -> list[str]:
    return [f"Tell me about {TOPICS[i % len(TOPICS)]}." for i in range(count)]


def draft_directory(num_layers: int) -> Path:
    """The default model cut to its first num_layers layers (final norm and LM head
    kept), written by transformers into the cache once."""
    import torch
    import transformers

    from benchmarks.peer_vllm import transformers_directory
    from jpaged.model.default_model import cache_directory

    directory = cache_directory() / "smollm2" / f"draft-{num_layers}-layers"
    if (directory / "model.safetensors").is_file():
        return directory
    source = transformers_directory()
    progress(f"writing {directory} with transformers (once)")
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


class Jpaged:
    """jpaged's engines: without speculation, with n-gram and with draft-model proposals."""

    def __init__(self, args, draft: Path):
        from jpaged.entrypoints.llm import LLM

        self.args = args
        common = dict(max_num_seqs=max(BATCHES), max_model_len=2048)
        ngram = {"method": "ngram", "num_speculative_tokens": args.k}
        self.engines = {
            "jpaged": LLM(args.model, **common),
            "jpaged_ngram": LLM(args.model, speculative_config=ngram, **common),
            "jpaged_draft": LLM(args.model, speculative_config={
                "method": "draft_model", "model": str(draft),
                "num_speculative_tokens": args.k}, **common),
        }
        engine = self.engines["jpaged"].engine
        self.encode = lambda text: engine.apply_chat_template([{"role": "user",
                                                                 "content": text}])
        for name, llm in self.engines.items():
            progress(f"{name}: warming up ...")
            llm.engine.warmup()

    def run(self, name: str, prompts: list[list[int]], batch: int) -> dict:
        from jpaged.sampling_params import SamplingParams

        llm = self.engines[name]
        params = SamplingParams(temperature=0.0, max_tokens=self.args.max_tokens,
                                ignore_eos=True)
        before = llm.engine.stats.spec_decode.summary()
        started = time.perf_counter()
        outputs = []
        for first in range(0, len(prompts), batch):
            outputs += llm.generate(prompts[first:first + batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        after = llm.engine.stats.spec_decode.summary()
        tokens = [o.outputs[0].token_ids for o in outputs]
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        drafts = after["num_drafts"] - before["num_drafts"]
        return {"output_tokens_per_s": sum(map(len, tokens)) / elapsed, "tokens": tokens,
                "draft_acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


class Transformers:
    """transformers' generate: plain, with prompt lookup, with the draft as assistant."""

    def __init__(self, args, draft: Path):
        import torch
        import transformers

        from benchmarks.peer_vllm import transformers_directory

        torch.set_num_threads(args.torch_threads)
        self.torch, self.args = torch, args
        load = transformers.AutoModelForCausalLM.from_pretrained
        self.model = load(transformers_directory(), dtype=torch.float32).eval()
        self.assistant = load(draft, dtype=torch.float32).eval()
        self.options = {"transformers": {},
                        "transformers_lookup": {"prompt_lookup_num_tokens": args.k,
                                                "max_matching_ngram_size": LOOKUP_MAX},
                        "transformers_assisted": {"assistant_model": self.assistant}}
        for options in self.options.values():
            self._generate([1, 2, 3, 4], 4, options)

    def _generate(self, prompt: list[int], max_new_tokens: int, options: dict) -> list[int]:
        torch = self.torch
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, pad_token_id=0, **options)
        return out[0, len(prompt):].tolist()

    def run(self, name: str, prompts: list[list[int]]) -> dict:
        started = time.perf_counter()
        tokens = [self._generate(p, self.args.max_tokens, self.options[name]) for p in prompts]
        elapsed = time.perf_counter() - started
        return {"output_tokens_per_s": sum(map(len, tokens)) / elapsed, "tokens": tokens}


def _summary(runs: list[dict], reference: list[list[int]] | None) -> dict:
    """The median over rounds, and how many outputs equal the reference's."""
    summary = {"output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
               "rounds_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}
    for key in ("draft_acceptance_rate", "mean_acceptance_length"):
        if runs[0].get(key) is not None:
            summary[key] = statistics.median(r[key] for r in runs)
    if reference is not None:
        summary["identical_to_jpaged"] = sum(
            a == b for a, b in zip(runs[-1]["tokens"], reference, strict=True))
    return summary


def measure(args) -> dict:
    draft = draft_directory(args.draft_layers)
    jpaged, transformers = Jpaged(args, draft), Transformers(args, draft)
    workloads = {"repetitive": repetitive_prompts(args.num_prompts),
                 "ordinary": ordinary_prompts(args.num_prompts)}
    results = {}
    for workload, texts in workloads.items():
        prompts = [jpaged.encode(text) for text in texts]
        for batch in BATCHES:
            systems = list(jpaged.engines) + (list(transformers.options) if batch == 1 else [])
            runs = {name: [] for name in systems}
            for round_ in range(args.rounds):
                for name in systems if round_ % 2 == 0 else systems[::-1]:
                    progress(f"{workload} batch {batch} round {round_}: {name}")
                    runs[name].append(jpaged.run(name, prompts, batch) if name in jpaged.engines
                                      else transformers.run(name, prompts))
            reference = runs["jpaged"][-1]["tokens"]
            results[f"{workload}_batch{batch}"] = {
                name: _summary(r, None if name == "jpaged" else reference)
                for name, r in runs.items()}
    return results, verification_cost(jpaged.engines["jpaged_ngram"], args.k)


def verification_cost(llm, k: int, context: int = 512, repeats: int = 15) -> dict:
    """Milliseconds of the model step of one sequence at `context` tokens with 1 new token
    and with 1 + k, alternating (medians), and of its matrix products alone: every layer's
    weights and the vocabulary head times 1 and 1 + k rows, in one jitted function."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jpaged.core.attention_metadata import AttentionMetadata

    runner, shapes = llm.engine.runner, llm.engine.shapes
    block_size = runner.block_size
    width = shapes.buckets.min_blocks_per_seq
    table = np.zeros((runner.groups.num_groups, 1, width), np.int32)
    table[:, 0, : context // block_size] = np.arange(1, context // block_size + 1)

    def inputs(num_tokens: int):
        positions = np.arange(context - num_tokens, context, dtype=np.int32)
        slots = table[:, 0, positions // block_size] * block_size + positions % block_size
        return np.zeros(num_tokens, np.int32), AttentionMetadata(
            slot_mapping=slots.astype(np.int32), positions=positions, block_tables=table,
            context_lens=np.array([context], np.int32),
            query_start_loc=np.array([0, num_tokens], np.int32),
            logits_indices=np.arange(1 + k, dtype=np.int32) % num_tokens)

    # Every weight matrix (a stack of layers' counts each layer's), read once per call.
    matrices = [matrix for leaf in jax.tree.leaves(runner.params) if leaf.ndim >= 2
                for matrix in leaf.reshape(-1, *leaf.shape[-2:])]

    @functools.partial(jax.jit, static_argnums=0)
    def products(num_rows, matrices):
        return sum((jnp.ones((num_rows, m.shape[0]), m.dtype) @ m).sum() for m in matrices)

    times = {"decode_step": [], "verifying_step": [], "products_1_row": [],
             f"products_{1 + k}_rows": []}
    calls = {
        "decode_step": lambda: runner.execute(*inputs(1), decode_only=True, num_rows=1)[0],
        "verifying_step": lambda: runner.execute(*inputs(1 + k), decode_only=False,
                                                 num_rows=1 + k)[0],
        "products_1_row": lambda: products(1, matrices),
        f"products_{1 + k}_rows": lambda: products(1 + k, matrices),
    }
    for call in calls.values():
        call().block_until_ready()
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call().block_until_ready()
            times[name].append((time.perf_counter() - started) * 1e3)
    medians = {f"{name}_ms": statistics.median(values) for name, values in times.items()}
    medians["verifying_over_decode"] = medians["verifying_step_ms"] / medians["decode_step_ms"]
    medians["products_ratio"] = (medians[f"products_{1 + k}_rows_ms"]
                                 / medians["products_1_row_ms"])
    return medians


def _ratios(results: dict) -> dict:
    ratios = {}
    for case, systems in results.items():
        base = systems["jpaged"]["output_tokens_per_s"]
        for name in ("jpaged_ngram", "jpaged_draft"):
            ratios[f"{case}_{name}_over_jpaged"] = systems[name]["output_tokens_per_s"] / base
        peers = {"jpaged": "transformers", "jpaged_ngram": "transformers_lookup",
                 "jpaged_draft": "transformers_assisted"}
        for ours, theirs in peers.items():
            if theirs in systems:
                ratios[f"{case}_{ours}_over_{theirs}"] = (
                    systems[ours]["output_tokens_per_s"] / systems[theirs]["output_tokens_per_s"])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="every code path on a few short requests (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.num_prompts, args.max_tokens = 1, 2, 8
    report = new_report("benchmarks.speculative", peers=("torch", "transformers"))
    report["settings"] = {**vars(args), "ngram_lookup": [LOOKUP_MIN, LOOKUP_MAX],
                          "batches": list(BATCHES), "greedy": True}
    results, step_cost = measure(args)
    record_end_load(report)
    ratios = _ratios(results)
    report["results"] = results
    report["ratios"] = ratios
    report["verification_cost"] = step_cost
    report["targets"] = {
        "ngram_repetitive_batch1_at_least_1.8x": ratios[
            "repetitive_batch1_jpaged_ngram_over_jpaged"] >= 1.8,
        "ngram_ordinary_batch1_at_least_0.95x": ratios[
            "ordinary_batch1_jpaged_ngram_over_jpaged"] >= 0.95,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
