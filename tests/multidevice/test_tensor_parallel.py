"""Tensor and data parallelism on 8 simulated CPU devices, against one device.

Run by tests/test_multidevice.py in a process of its own (XLA_FLAGS set before JAX
starts). The oracle is the same engine on one device: greedy tokens must be
identical, except at a step where the one-device top-2 log-probabilities lie
within NEAR_TIE of each other (a sharded sum adds in another order); such a
step ends the comparison of its sequence, whose contexts then differ.
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import kernels_pallas
from jpaged import __main__ as cli
from jpaged.core.step_shapes import BucketSizes, step_shapes
from jpaged.engine.async_engine import AsyncLLMEngine
from jpaged.engine.stats import num_compilations
from jpaged.entrypoints.llm import LLM
from jpaged.entrypoints.serving import OpenAIServing
from jpaged.memory.allocator import BlockOps
from jpaged.model.config import LlamaConfig
from jpaged.model.llama import LlamaForCausalLM
from jpaged.model.loader import load_model
from jpaged.model.sharding import bytes_per_device, model_mesh, shard_model
from jpaged.sampling_params import SamplingParams
from jpaged.worker.model_runner import ModelRunner
from tests.plugins.hf_models import transformers_answer
from tests.plugins.kernels import kernel_interpret

NEAR_TIE = 1e-4
NUM_DEVICES = 8
# One padded shape for mixed steps and one for decode steps: two compiles per engine.
ENGINE = dict(block_size=8, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, persistent_compilation_cache=False,
              buckets=BucketSizes(min_num_tokens=64, min_num_seqs=4, min_blocks_per_seq=16))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter", "collective-broadcast")


@pytest.fixture(scope="module", autouse=True)
def simulated_devices():
    assert jax.device_count() >= NUM_DEVICES, "run with --xla_force_host_platform_device_count=8"


def prompts(vocab_size: int, lengths=(5, 11, 17), seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(1, vocab_size, n).tolist()} for n in lengths]


def near_ties_or_fail(reference, outputs) -> int:
    """Assert greedy tokens identical up to near ties; the number of near-tie steps met."""
    near_ties = 0
    for expected, got in zip(reference, outputs, strict=True):
        expected, got = expected.outputs[0], got.outputs[0]
        assert len(got.token_ids) == len(expected.token_ids)
        for step, (want, have) in enumerate(zip(expected.token_ids, got.token_ids, strict=True)):
            if want != have:
                top = sorted((lp.logprob for lp in expected.logprobs[step].values()),
                             reverse=True)
                assert top[0] - top[1] < NEAR_TIE, (
                    f"step {step}: token {have} instead of {want}, top-2 gap {top[0] - top[1]}")
                near_ties += 1
                break
    return near_ties


def collective_counts(hlo: str) -> tuple[dict[str, int], int, dict[str, int]]:
    """(collectives inside the loop body that holds them, that loop's trip count,
    collectives in the whole module) of a compiled step's HLO text. The loop is one
    of the entry computation's (the kernels' own loops are nested in the layer loop's
    body; XLA may split loop-invariant work into a loop of its own beside it)."""
    computations = dict(re.findall(r"^(?:ENTRY )?%(\S+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M))
    entry = re.search(r"^ENTRY %(\S+)", hlo, re.M).group(1)
    loops = re.findall(r" while\(.*body=%([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"",
                       computations[entry])

    def counts(text: str) -> dict[str, int]:
        found = {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in COLLECTIVES}
        return {op: n for op, n in found.items() if n}

    holding = [(counts(computations[body]), int(trips)) for body, trips in loops
               if counts(computations[body])]
    assert len(holding) == 1, f"expected collectives in one loop, got {holding}"
    return *holding[0], counts(hlo)


def kv_bytes(hf_config, num_kv_heads: int) -> int:
    """Bytes of one of the single-device caches (keys or values), from the model's config:
    a block holds every layer, or with global and sliding layers (Gemma 3's layer_types)
    as many layers as the rarer kind has (its KV cache groups)."""
    kinds = hf_config.get("layer_types") or ["full_attention"]
    buffers = (hf_config["num_hidden_layers"] if len(set(kinds)) == 1
               else min(kinds.count(kind) for kind in set(kinds)))
    return (buffers * num_kv_heads * ENGINE["num_blocks"]
            * ENGINE["block_size"] * hf_config["hidden_size"]
            // hf_config["num_attention_heads"] * 4)


@pytest.fixture(scope="module")
def loaded_models(tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir, tiny_phi3_dir,
                  tiny_gemma3_dir):
    return {"llama": load_model(tiny_llama_dir), "qwen2": load_model(tiny_qwen2_dir),
            "mistral": load_model(tiny_mistral_dir), "phi3": load_model(tiny_phi3_dir),
            "gemma3": load_model(tiny_gemma3_dir)}


@pytest.fixture(scope="module")
def one_device_outputs(loaded_models):
    """{(model, backend): the one-device greedy outputs}, built on first use."""
    cache = {}

    def outputs(name: str, backend: str, interpret: bool):
        if (name, backend) not in cache:
            llm = LLM(name, loaded=loaded_models[name], attention_backend=backend,
                      interpret=interpret, **ENGINE)
            vocab = loaded_models[name][1].vocab_size
            cache[name, backend] = llm.generate(prompts(vocab), GREEDY)
        return cache[name, backend]

    return outputs


@pytest.mark.parametrize("size,name,option", [
    (2, "llama", {"num_decode_steps": 4}),
    pytest.param(4, "qwen2", {"async_scheduling": True}, marks=pytest.mark.full)])
def test_decode_loop_and_async_scheduling_under_tensor_parallelism(size, name, option,
                                                                   loaded_models,
                                                                   one_device_outputs):
    """Decode steps on the device (the allocator's pool and the tables replicated, the
    model's collectives inside the loop), and steps fed the previous step's sharded
    tokens (async scheduling), match one device."""
    reference = one_device_outputs(name, "xla", False)
    llm = LLM(name, loaded=loaded_models[name], attention_backend="xla",
              tensor_parallel_size=size, **option, **ENGINE)
    vocab = loaded_models[name][1].vocab_size
    near_ties = near_ties_or_fail(reference, llm.generate(prompts(vocab), GREEDY))
    print(f"TP={size} {name} {option}: {near_ties} near-tie steps")
    if "num_decode_steps" in option:
        assert llm.engine.stats.num_steps < 8 + len(prompts(vocab))
    llm.engine.check_invariants()


PALLAS = kernels_pallas.pallas_implementation(False)
# Every model at the sizes that split or replicate its KV heads, the backends in turn so
# that each meets both sizes and models with and without windows (each backend's window
# against its reference is the kernels' tests' business, on one device).
TP_CASES = [(2, "llama", PALLAS), (4, "llama", "xla"), (2, "qwen2", "xla"),
            (4, "qwen2", "reference"), (2, "mistral", "reference"), (2, "phi3", PALLAS),
            (4, "gemma3", PALLAS)]


@pytest.mark.parametrize("size,name,backend", [
    pytest.param(*case, marks=() if i == 0 else pytest.mark.full)
    for i, case in enumerate(TP_CASES)])
def test_tensor_parallel_greedy_matches_one_device(
    size, name, backend, loaded_models, one_device_outputs, request
):
    """4 query heads, 2 KV heads: TP 2 splits the KV heads, TP 4 replicates each on two
    devices; Mistral's window of 8 is crossed by every prompt; Phi-3's fused checkpoint
    projections are regrouped per device; Gemma 3's local and global layers run with
    their KV heads replicated. Also: the cache's bytes per
    device, and the collectives of the compiled decode step (and mixed step, at TP 2): two
    all-reduces per layer, nothing else."""
    interpret = kernel_interpret(backend) if backend in ("tpu", "triton") else False
    reference = one_device_outputs(name, backend, interpret)
    llm = LLM(name, loaded=loaded_models[name], attention_backend=backend,
              interpret=interpret, tensor_parallel_size=size, **ENGINE)
    vocab = loaded_models[name][1].vocab_size
    near_ties = near_ties_or_fail(reference, llm.generate(prompts(vocab), GREEDY))
    print(f"TP={size} {name} {backend}: {near_ties} near-tie steps")

    model_dir = request.getfixturevalue(f"tiny_{name}_dir")
    hf_config = json.loads((model_dir / "config.json").read_text())
    num_kv_heads = hf_config["num_key_value_heads"]
    runner = llm.engine.runner
    for cache in runner.kv_cache:
        assert cache.sharding.spec == P(None, "model")
        assert len(cache.sharding.device_set) == size
        # Replicated KV heads: each device holds one head, 1 / num_kv_heads of the total.
        expected = kv_bytes(hf_config, num_kv_heads) // min(size, num_kv_heads)
        assert bytes_per_device(cache) == expected

    shapes = [(4, 4, 16, True)] + ([(64, 4, 16, False)] if size == 2 else [])
    for num_tokens, num_seqs, num_blocks, decode_only in shapes:
        compiled = runner.compile_step(num_tokens, num_seqs, num_blocks, decode_only)
        body, trips, module = collective_counts(compiled.as_text())
        assert body == {"all-reduce": 2}
        assert trips == hf_config["num_hidden_layers"]
        assert module == body


@pytest.mark.full
@pytest.mark.default_model
def test_smollm2_three_way_matches_one_device(smollm2):
    """9 query heads, 3 KV heads over 3 devices, xla backend."""
    model, config, tokenizer = smollm2
    engine = dict(ENGINE, max_num_seqs=2)
    texts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    one = LLM("smollm2", loaded=smollm2, attention_backend="xla", **engine)
    reference = one.generate(texts, params)
    three = LLM("smollm2", loaded=smollm2, attention_backend="xla", tensor_parallel_size=3,
                **engine)
    near_ties = near_ties_or_fail(reference, three.generate(texts, params))
    print(f"TP=3 smollm2 xla: {near_ties} near-tie steps")
    one_cache, three_cache = one.engine.runner.kv_cache[0], three.engine.runner.kv_cache[0]
    assert bytes_per_device(three_cache) * 3 == bytes_per_device(one_cache)


@pytest.mark.full
@pytest.mark.default_model
def test_gemma3_two_way_matches_one_device(gemma3):
    """Gemma 3 270M: 4 query heads over 2 devices, its one KV head replicated on both;
    a 600-token prompt crosses the 512-token window of its sliding layers."""
    _, config, tokenizer = gemma3
    long_prompt = tokenizer.encode("".join(f"Line {i}: the number {i} squared is {i * i}.\n"
                                           for i in range(48)))
    assert len(long_prompt) > 600 > config.sliding_window
    prompts = [tokenizer.encode("The capital of France is"), long_prompt]
    # Blocks of 3 layers (its 6 KV cache groups): 960 hold what 160 blocks of all 18 do.
    engine = dict(ENGINE, max_num_seqs=2, max_model_len=1024, num_blocks=960,
                  max_num_batched_tokens=256)
    one = LLM("gemma3", loaded=gemma3, attention_backend="xla", **engine)
    reference = one.generate(prompts, GREEDY)
    two = LLM("gemma3", loaded=gemma3, attention_backend="xla", tensor_parallel_size=2, **engine)
    near_ties = near_ties_or_fail(reference, two.generate(prompts, GREEDY))
    print(f"TP=2 gemma3: {near_ties} near-tie steps")
    one_cache, two_cache = one.engine.runner.kv_cache[0], two.engine.runner.kv_cache[0]
    assert bytes_per_device(two_cache) == bytes_per_device(one_cache)  # the KV head replicated


@pytest.fixture(scope="module")
def two_by_two(loaded_models) -> LLM:
    """TP 2 x DP 2 on 4 devices, xla backend; tests leave it with no request."""
    return LLM("llama", loaded=loaded_models["llama"], attention_backend="xla",
               tensor_parallel_size=2, data_parallel_size=2, **ENGINE)


def test_two_replicas_of_two_devices_match_one_device(two_by_two, loaded_models,
                                                      one_device_outputs):
    """TP 2 x DP 2 on 4 devices: disjoint device pairs, requests spread evenly."""
    reference = one_device_outputs("llama", "xla", False)
    llm = two_by_two
    replicas = llm.engine.replicas
    devices = [r.runner.kv_cache[0].sharding.device_set for r in replicas]
    assert [len(d) for d in devices] == [2, 2] and not devices[0] & devices[1]

    vocab = loaded_models["llama"][1].vocab_size
    for i, prompt in enumerate(prompts(vocab, lengths=(3, 4, 5, 6))):
        llm.engine.add_request(f"spread-{i}", prompt, GREEDY)
    assert [r.num_unfinished_requests() for r in replicas] == [2, 2]
    for i in range(4):
        llm.engine.abort(f"spread-{i}")
    assert not llm.engine.has_unfinished_requests()

    near_ties = near_ties_or_fail(reference, llm.generate(prompts(vocab), GREEDY))
    print(f"TP=2 x DP=2 llama xla: {near_ties} near-tie steps")
    assert all(r.block_manager.num_free_blocks == ENGINE["num_blocks"] - 1 for r in replicas)


def test_a_reserved_prefix_is_held_by_every_replica(two_by_two, loaded_models):
    """Each replica holds the prefix's blocks, so the prompts extending it hit them on
    whichever replica they land; releasing releases it everywhere."""
    llm, replicas = two_by_two, two_by_two.engine.replicas
    prefix = prompts(loaded_models["llama"][1].vocab_size, lengths=(20,), seed=3)[0]
    reserved = llm.reserve_prefix(prefix["prompt_token_ids"])
    assert (reserved.num_cached_tokens, reserved.num_blocks) == (16, 2)
    assert [r.block_manager.num_reserved_blocks for r in replicas] == [2, 2]
    extensions = [prefix["prompt_token_ids"] + [5 + i] for i in range(4)]
    outputs = llm.generate(extensions, GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [16] * 4
    llm.release_prefix(reserved)
    assert [r.block_manager.num_reserved_blocks for r in replicas] == [0, 0]
    with pytest.raises(ValueError, match="no prefix 1 is reserved"):
        llm.release_prefix(reserved)


async def _collect(stream) -> SimpleNamespace:
    """A request's deltas joined into one output: token ids and log-probabilities."""
    token_ids, logprobs = [], []
    async for delta in stream:
        token_ids += delta.outputs[0].token_ids
        logprobs += delta.outputs[0].logprobs
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, logprobs=logprobs)])


async def _serve_concurrently(engine: AsyncLLMEngine, requests: list) -> list:
    streams = [await engine.generate(f"async-{i}", prompt, GREEDY)
               for i, prompt in enumerate(requests)]
    return await asyncio.gather(*(_collect(stream) for stream in streams))


@pytest.mark.full
def test_async_engine_over_two_replicas_matches_one_device(two_by_two, loaded_models,
                                                           one_device_outputs):
    """The server's engine thread drives both replicas: concurrent greedy requests get
    the one-device tokens, each replica serves some, and the published state and
    /metrics count both replicas' pools."""
    reference = one_device_outputs("llama", "xla", False)
    replicas = two_by_two.engine.replicas
    finished_before = [r.stats.num_finished for r in replicas]
    engine = AsyncLLMEngine(two_by_two.engine)
    try:
        serving = OpenAIServing(engine, "tiny")
        vocab = loaded_models["llama"][1].vocab_size
        outputs = asyncio.run(_serve_concurrently(engine, prompts(vocab)))
    finally:
        engine.shutdown()
    near_ties = near_ties_or_fail(reference, outputs)
    print(f"AsyncLLMEngine TP=2 x DP=2 llama xla: {near_ties} near-tie steps")
    served = [r.stats.num_finished - before for r, before in zip(replicas, finished_before,
                                                                  strict=True)]
    assert sum(served) == 3 and min(served) >= 1, served
    pools = 2 * (ENGINE["num_blocks"] - 1)
    assert engine.state.kv_blocks_total == pools and engine.state.kv_blocks_used == 0
    assert f"jpaged:kv_cache_blocks_total {float(pools)}" in serving.metrics.render().decode()
    assert serving.models()["data"][0]["max_model_len"] == ENGINE["max_model_len"]


@pytest.mark.full
def test_data_parallel_summary_combines_the_replicas(two_by_two, loaded_models):
    """The summary of both replicas, against numpy over each replica's own figures."""
    vocab = loaded_models["llama"][1].vocab_size
    two_by_two.generate(prompts(vocab, lengths=(4, 9, 13, 21), seed=1), GREEDY)
    replicas = [r.stats for r in two_by_two.engine.replicas]
    summary = two_by_two.engine.stats.summary()

    def total(name: str) -> float:
        return np.sum([getattr(r, name) for r in replicas])

    pools = np.array([r.num_kv_blocks for r in replicas])
    steps = np.array([r.kv_utilization.count for r in replicas])
    used = np.array([r.kv_utilization.total for r in replicas]) * pools
    assert summary["steps"] == total("num_steps")
    assert summary["finished_requests"] == total("num_finished")
    assert summary["output_tokens"] == total("num_output_tokens")
    assert summary["preemptions"] == total("num_preemptions")
    assert summary["kv_utilization_mean"] == pytest.approx(used.sum() / (steps * pools).sum())
    assert summary["kv_utilization_peak"] == max(r.kv_utilization.peak for r in replicas)
    assert summary["running_mean"] == pytest.approx(
        np.sum([r.num_running.total for r in replicas]) / steps.sum())
    assert summary["prefix_cache_hit_rate"] == pytest.approx(
        total("prefix_cache_hit_tokens") / total("prefix_cache_query_tokens"))
    elapsed = (max(r.last_step_time for r in replicas)
               - min(r.first_step_time for r in replicas))
    assert summary["output_tokens_per_s"] == pytest.approx(total("num_output_tokens") / elapsed)
    ttft = np.concatenate([list(r.ttft) for r in replicas])
    assert summary["ttft_s"]["p50"] == pytest.approx(np.percentile(ttft, 50))
    assert summary["ttft_s"]["p99"] == pytest.approx(np.percentile(ttft, 99))


@pytest.mark.full
def test_data_parallel_warmup_leaves_nothing_to_compile(two_by_two, loaded_models,
                                                       no_compilation_cache):
    """warmup() compiles each replica's step shapes (for its own devices): serving then
    compiles nothing."""
    jax.clear_caches()  # the replicas served other tests: their steps are compiled already
    engine = two_by_two.engine
    assert jax.config.jax_compilation_cache_dir is None  # a hit would not count as a compile
    num_shapes = engine.warmup()
    replica = engine.replicas[0]
    assert num_shapes == len(step_shapes(replica.shapes.buckets, ENGINE["max_num_batched_tokens"],
                                         ENGINE["max_num_seqs"], ENGINE["max_model_len"]
                                         // ENGINE["block_size"]))
    before = num_compilations()
    vocab = loaded_models["llama"][1].vocab_size
    two_by_two.generate(prompts(vocab, lengths=(2, 7, 30, 3, 12), seed=2), GREEDY)
    assert num_compilations() - before == 0


def test_cli_flags_reach_the_engine(tiny_llama_dir, capsys, jpaged_logger_restored):
    """`generate --tensor-parallel-size 2 --data-parallel-size 2`: two replicas (two KV
    pools reported), each with half the KV bytes per token of one device, answering as
    transformers does; bad sizes are the engine's one-line errors."""
    answers = ["the theme in the", "in the air"]
    status = cli.main(["generate", "--model", str(tiny_llama_dir), "--raw", "--max-tokens", "5",
                       "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--stats",
                       *answers])
    out, err = capsys.readouterr()
    assert status == 0, err
    hf_config = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    bytes_per_token = (2 * hf_config["num_hidden_layers"] * hf_config["num_key_value_heads"]
                       // 2 * head_dim * 4)
    assert len(re.findall(rf"KV cache: .*\({bytes_per_token} bytes per token\)", err)) == 2
    text, stats = out.split("\n{", 1)
    expected = "".join(f"### {p}\n{transformers_answer(tiny_llama_dir, p, 5)}\n"
                       for p in answers)
    assert text + "\n" == expected
    assert json.loads("{" + stats)["finished_requests"] == 2

    for flag, value, message in (("--tensor-parallel-size", "3", "4 query heads"),
                                 ("--data-parallel-size", "0", "must be >= 1, got 0"),
                                 ("-tp", "4", r"\(4\) x data_parallel_size \(3\) = 12")):
        extra = ["-dp", "3"] if flag == "-tp" else []
        status = cli.main(["generate", "--model", str(tiny_llama_dir), flag, value, *extra, "x"])
        err = capsys.readouterr().err
        assert status == 1 and re.search(rf"^error: .*{message}", err, re.M), err


def test_bad_sizes_name_both_numbers(loaded_models):
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\).*4 query heads"):
        LLM("llama", loaded=loaded_models["llama"], tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match=r"\(16\).*exceeds the 8 available"):
        LLM("llama", loaded=loaded_models["llama"], tensor_parallel_size=16, **ENGINE)
    with pytest.raises(ValueError, match=r"\(4\) x data_parallel_size \(3\) = 12 devices"):
        LLM("llama", loaded=loaded_models["llama"], tensor_parallel_size=4,
            data_parallel_size=3, **ENGINE)


@pytest.mark.full
def test_an_int8_cache_and_its_scales_split_by_head_match_one_device(loaded_models):
    """TP 2 on an int8 cache: the pages and their per-head scales are split by KV head
    (each device holds its heads' scales), and greedy tokens equal one device's."""
    loaded = loaded_models["llama"]
    options = dict(ENGINE, attention_backend="xla", kv_cache_dtype="int8")
    vocab = loaded[1].vocab_size
    reference = LLM("llama", loaded=loaded, **options).generate(prompts(vocab), GREEDY)
    llm = LLM("llama", loaded=loaded, tensor_parallel_size=2, **options)
    print(f"TP=2 int8: {near_ties_or_fail(reference, llm.generate(prompts(vocab), GREEDY))} "
          "near-tie steps")
    config = loaded[1]
    per_device = (config.num_layers, config.num_kv_heads // 2, ENGINE["num_blocks"],
                  ENGINE["block_size"])
    for pages in llm.engine.runner.kv_cache:
        assert isinstance(pages, kernels_pallas.EncodedPages)
        for leaf, width in ((pages.values, config.head_dim), (pages.scales, 4)):
            assert leaf.sharding.spec == P(None, "model") and len(leaf.sharding.device_set) == 2
            assert bytes_per_device(leaf) == np.prod(per_device) * width


@pytest.mark.parametrize("kv_dtype", [np.float32, pytest.param(jnp.int8, marks=pytest.mark.full)])
def test_swaps_and_copies_keep_the_cache_split_by_head(kv_dtype):
    """Swap out, swap in, copy-on-write copies and the host tier's store and load on a
    cache over 4 devices move the same blocks as numpy indexing of the whole cache (a
    quantized cache's scales with their pages), and leave it split by KV head: a host
    block holds every device's heads."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    mesh = model_mesh(jax.devices()[:4])
    model, sharded_config = shard_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), config, mesh)
    runner = ModelRunner(model, sharded_config, num_blocks=8, block_size=4, num_host_blocks=4,
                         attention_backend="xla", mesh=mesh, kv_dtype=kv_dtype)
    leaves, tree = jax.tree.flatten(runner.kv_cache)
    runner.kv_cache = jax.tree.unflatten(tree, [
        jax.device_put((10 * np.random.default_rng(i).normal(size=c.shape)).astype(c.dtype),
                       c.sharding)
        for i, c in enumerate(leaves)])
    before = [np.array(leaf) for leaf in jax.tree.leaves(runner.kv_cache)]
    none = np.zeros((0, 2), np.int32)
    runner.apply_block_ops(BlockOps(swap_out=np.array([[3, 1]], np.int32), swap_in=none,
                                    copies=none))
    runner.apply_block_ops(BlockOps(swap_out=none, swap_in=np.array([[1, 5]], np.int32),
                                    copies=np.array([[2, 6]], np.int32),
                                    store=np.array([[4, 2]], np.int32)))
    runner.apply_block_ops(BlockOps(none, none, none, load=np.array([[2, 7]], np.int32)))
    for expected, cache in zip(before, jax.tree.leaves(runner.kv_cache), strict=True):
        expected[:, :, 5], expected[:, :, 6] = expected[:, :, 3], expected[:, :, 2]
        expected[:, :, 7] = expected[:, :, 4]
        assert cache.sharding.spec == P(None, "model") and len(cache.sharding.device_set) == 4
        np.testing.assert_array_equal(np.asarray(cache), expected)
