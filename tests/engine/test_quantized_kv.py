"""An engine on a quantized KV cache: the scales travel with their blocks.

Copy-on-write, swaps and prefix-cache hits move or share blocks without computing
anything again, so an engine that moves them must read the very values and scales
an engine that never moved a block reads: equal log-probabilities within float32
tolerance. Recompute preemption and a cache rebuilt after a failed step compute
K/V again, in steps of other shapes, and a last-bit difference may move a value by
one quantization step (twice the largest rounding error): their greedy tokens must
equal the unpreempted engine's and their log-probabilities differ from them by at
most twice what quantizing the cache moves them from a float32 cache's. An int8 cache's
rotated basis is measured against transformers on keys with an outlier channel.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.engine import backend_choice
from jpaged.engine.config import EngineConfig
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.engine.test_faults import fail_consuming_the_cache, serve
from tests.plugins.hf_models import (
    fed_logits,
    oracle_torch,
    oracle_transformers,
    randomize,
    tiny_tokenizer,
)

KV_DTYPES = ["int8", "fp8_e4m3"]
BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)
ENGINE = dict(block_size=8, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, buckets=BUCKETS, persistent_compilation_cache=False)
SMALL_POOL = dict(num_blocks=8, max_model_len=40)
FLOAT32_TOLERANCE = 1e-5


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts(loaded):
    rng = np.random.default_rng(3)
    return [rng.integers(3, loaded[1].vocab_size, n).tolist() for n in (13, 22, 5, 30)]


def _llm(loaded, **kwargs) -> LLM:
    return LLM("tiny", loaded=loaded, **(ENGINE | kwargs))


def top_logprobs(completion) -> np.ndarray:
    """[steps, 2]: the two highest log-probabilities of each step, highest first."""
    return np.array([sorted((entry.logprob for entry in step.values()), reverse=True)
                     for step in completion.logprobs])


def assert_same_reads(completion, expected) -> None:
    assert completion.token_ids == expected.token_ids
    np.testing.assert_allclose(top_logprobs(completion), top_logprobs(expected),
                               atol=FLOAT32_TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def unmoved(loaded, prompts):
    """{kv dtype: each prompt's greedy completion in an engine whose pool never fills}."""
    return {dtype: [out.outputs[0] for out in _llm(loaded, kv_cache_dtype=dtype).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy())] for dtype in [*KV_DTYPES, "auto"]}


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_forked_samples_read_their_parents_blocks_and_scales(loaded, prompts, unmoved,
                                                             kv_cache_dtype):
    """n = 2 shares the prompt's blocks; the first decode copies the shared partial last
    block (13 tokens in blocks of 8) before writing into it."""
    llm = _llm(loaded, kv_cache_dtype=kv_cache_dtype)
    (output,) = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(n=2))
    for sample in output.outputs:
        assert_same_reads(sample, unmoved[kv_cache_dtype][0])


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_swapped_blocks_come_back_with_their_scales(loaded, prompts, unmoved, kv_cache_dtype):
    llm = _llm(loaded, kv_cache_dtype=kv_cache_dtype, preemption_mode="swap",
               kv_offloading_size=0.01, **SMALL_POOL)
    finished = serve(llm, prompts, [greedy()] * len(prompts))
    assert llm.engine.scheduler.num_preemptions > 0
    for index, expected in enumerate(unmoved[kv_cache_dtype]):
        assert_same_reads(finished[index].outputs[0], expected)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_a_prefix_hit_reads_the_cached_values_and_scales(loaded, prompts, unmoved,
                                                         kv_cache_dtype):
    """22 tokens prefill in chunks of 16 and 6; the second time the first two blocks of
    8 are hits and the last 6 tokens are computed again in a step of the same shape."""
    llm = _llm(loaded, kv_cache_dtype=kv_cache_dtype)
    prompt = {"prompt_token_ids": prompts[1]}
    (miss,) = llm.generate([prompt], greedy())
    (hit,) = llm.generate([prompt], greedy())
    assert llm.engine.block_manager.prefix_cache_stats.hit_tokens >= 16
    assert_same_reads(miss.outputs[0], unmoved[kv_cache_dtype][1])
    assert_same_reads(hit.outputs[0], miss.outputs[0])


def quantization_bound(unmoved, kv_cache_dtype) -> float:
    """Twice the largest move quantization alone makes in these log-probabilities."""
    return 2 * max(np.abs(top_logprobs(q) - top_logprobs(f)).max()
                   for q, f in zip(unmoved[kv_cache_dtype], unmoved["auto"], strict=True))


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_recompute_keeps_greedy_tokens_within_the_quantization_bound(loaded, prompts, unmoved,
                                                                      kv_cache_dtype):
    llm = _llm(loaded, kv_cache_dtype=kv_cache_dtype, **SMALL_POOL)
    finished = serve(llm, prompts, [greedy()] * len(prompts))
    assert llm.engine.scheduler.num_preemptions > 0
    bound = quantization_bound(unmoved, kv_cache_dtype)
    for index, expected in enumerate(unmoved[kv_cache_dtype]):
        completion = finished[index].outputs[0]
        assert completion.token_ids == expected.token_ids
        assert np.abs(top_logprobs(completion) - top_logprobs(expected)).max() <= bound


def test_a_consumed_quantized_cache_is_rebuilt_with_its_scales(loaded, prompts, unmoved,
                                                               monkeypatch):
    """The donated cache (values and scales) is consumed by a failing step while two
    requests run: they fail, the engine rebuilds both arrays of pages and scales, and
    the waiting requests, then all four again, are served on the rebuilt cache."""
    llm = _llm(loaded, kv_cache_dtype="int8", max_num_seqs=2)
    fired = fail_consuming_the_cache(monkeypatch, llm.engine.runner, call=3)
    finished = serve(llm, prompts, [greedy()] * len(prompts))
    assert fired
    reasons = [finished[i].outputs[0].finish_reason for i in range(len(prompts))]
    assert reasons == ["error", "error", "length", "length"]
    monkeypatch.undo()
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    bound = quantization_bound(unmoved, "int8")
    served = [finished[2], finished[3], *again]
    for output, expected in zip(served, [*unmoved["int8"][2:], *unmoved["int8"]], strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == expected.token_ids
        assert np.abs(top_logprobs(completion) - top_logprobs(expected)).max() <= bound


def test_a_pool_of_fixed_bytes_holds_tokens_by_their_bytes(loaded):
    """bytes per token = 2 x layers x KV heads x (head_dim x itemsize, plus a float32
    scale per head when quantized); the pool holds memory // (block_size x that)."""
    config = loaded[1]
    memory, block_size = 2**18, 8
    per_head = {"auto": 4 * config.head_dim, "bfloat16": 2 * config.head_dim,
                "int8": config.head_dim + 4, "fp8_e5m2": config.head_dim + 4}
    for kv_cache_dtype, head_bytes in per_head.items():
        llm = _llm(loaded, kv_cache_dtype=kv_cache_dtype, num_blocks=None,
                   kv_cache_memory_bytes=memory, max_num_seqs=64)
        info = llm.engine.kv_cache_info
        token_bytes = 2 * config.num_layers * config.num_kv_heads * head_bytes
        assert info.bytes_per_token == token_bytes
        assert info.num_blocks == memory // (block_size * token_bytes)
        name = "float32" if kv_cache_dtype == "auto" else kv_cache_dtype
        assert f"of {name} ({token_bytes} bytes per token" in str(info)
        summary = llm.engine.stats.summary()
        assert (summary["kv_cache_dtype"], summary["kv_bytes_per_token"]) == (name, token_bytes)
        state = llm.engine.state()
        assert (state.kv_cache_dtype, state.kv_bytes_per_token) == (name, token_bytes)


def test_an_unknown_kv_cache_dtype_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int8'.*'fp8'.*"
                                         r"got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="int8_per_token_head").kv_cache_dtype == "int8"
    assert EngineConfig(kv_cache_dtype="fp8_per_token_head").kv_cache_dtype == "fp8_e4m3"


def test_a_requested_backend_that_cannot_read_the_dtype_raises(loaded):
    with pytest.raises(ValueError, match="multiple of 32 for int8, got 16"):
        _llm(loaded, kv_cache_dtype="int8", attention_backend="tpu", interpret=True,
             block_size=16)


def test_the_default_backend_falls_back_naming_the_dtype(loaded, prompts, unmoved, monkeypatch,
                                                          caplog):
    """The device's own kernel (here the TPU kernel, interpreted) cannot read int8 pages
    in blocks of 8: the engine warns, naming the dtype, and runs the "xla" loop."""
    monkeypatch.setattr(backend_choice, "device_attention_backend", lambda: "tpu")
    with caplog.at_level(logging.WARNING, logger="jpaged"):
        llm = _llm(loaded, kv_cache_dtype="int8", interpret=True)
    assert "multiple of 32 for int8" in caplog.text
    assert llm.engine.runner.attention_backend == "xla"
    (output,) = llm.generate([{"prompt_token_ids": prompts[0]}], greedy())
    assert_same_reads(output.outputs[0], unmoved["int8"][0])


def test_the_tpu_kernel_reads_int8_pages_in_its_default_blocks(loaded, prompts, unmoved):
    """Left unset, the block size is 32 for the TPU kernel's 1-byte pages."""
    llm = LLM("tiny", loaded=loaded, kv_cache_dtype="int8", attention_backend="tpu",
              interpret=True, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, persistent_compilation_cache=False)
    assert llm.engine.kv_cache_info.block_size == 32
    (output,) = llm.generate([{"prompt_token_ids": prompts[0]}],
                             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert output.outputs[0].token_ids == unmoved["int8"][0].token_ids[:4]


def wide_head_llama_dir(directory, outlier: float):
    """A random Llama with SmolLM2's head_dim of 64, one channel of every key (and its
    RoPE pair) `outlier` times larger than the rest, as in Llama's and Gemma's real keys."""
    torch, transformers = oracle_torch(), oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = randomize(transformers.LlamaForCausalLM(config), seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[[3, 35]] *= outlier
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def int8_prompt_logprob_error(model_dir, prompts) -> float:
    """The mean difference between an int8 cache's prompt log-probabilities and
    transformers' (float32, no cache quantization) on the same weights."""
    torch, transformers = oracle_torch(), oracle_transformers()
    oracle = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    llm = _llm(load_model(model_dir), kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    errors = []
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = torch.log_softmax(torch.from_numpy(fed_logits(oracle, prompt, [len(prompt)])),
                                     dim=-1).numpy()
        entries = zip(prompt[1:], output.prompt_logprobs[1:], strict=True)
        errors += [abs(entry[token].logprob - expected[position, token])
                   for position, (token, entry) in enumerate(entries)]
    return float(np.mean(errors))


def test_an_outlier_key_channel_costs_int8_no_more_than_twice_its_error_without(
        tmp_path, prompts):
    """Uniform int8 steps set by one large channel would round the small ones away (the
    unrotated cache's error grows about 4x with this outlier); in the rotated basis every
    channel shares the outlier, so the error stays about what it is without one."""
    without = int8_prompt_logprob_error(wide_head_llama_dir(tmp_path / "plain", 1.0), prompts)
    with_outlier = int8_prompt_logprob_error(wide_head_llama_dir(tmp_path / "outlier", 20.0),
                                             prompts)
    assert 0.0 < with_outlier <= 2 * without
