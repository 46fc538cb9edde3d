"""The Llama-family model against transformers' PyTorch model (the oracle).

Tiny random models of every family (tests/plugins/hf_models.py), saved by transformers,
run through jpaged's paged cache with scattered block tables, ragged batches, chunked
prefill and decode.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jpaged.model.config import LlamaConfig
from jpaged.model.llama import init_kv_cache
from jpaged.model.loader import load_model
from jpaged.model.rope import rope_inverse_frequencies
from kernels_pallas.quantization import as_float
from tests.plugins.hf_models import fed_logits
from tests.plugins.paged_pool import model_step

BLOCK_SIZE = 4


def oracle_logits(directory, token_ids: list[int]) -> np.ndarray:
    """f32 [len(token_ids), vocab]: transformers' logits at every position."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def random_tokens(rng, vocab_size: int, lengths) -> list[list[int]]:
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def test_ragged_prefill_matches_transformers(tiny_model_dir, paged_cache_book):
    model, config, _ = load_model(tiny_model_dir)
    prompts = random_tokens(np.random.default_rng(0), config.vocab_size, (1, 4, 9, 23, 40))
    book = paged_cache_book(BLOCK_SIZE, num_blocks=32, max_blocks_per_seq=16)
    input_ids, metadata = book.step(list(enumerate(prompts)), num_tokens=96, num_seqs=8)
    kv_cache = init_kv_cache(config, book.num_blocks, BLOCK_SIZE)

    logits, _ = model_step(*nnx.split(model), input_ids, kv_cache, metadata)

    expected = np.stack([oracle_logits(tiny_model_dir, p)[-1] for p in prompts])
    assert logits.shape == (8, config.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits[: len(prompts)]), expected, atol=1e-4, rtol=0)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_chunked_prefill_and_decode_match_transformers(tiny_model_dir, paged_cache_book):
    """Sequences arrive at different steps; long prompts are split into chunks under a token
    budget and share steps with other sequences' decodes. Every returned row must equal the
    oracle's logits at that sequence's last fed position."""
    model, config, _ = load_model(tiny_model_dir)
    streams = random_tokens(np.random.default_rng(1), config.vocab_size, (41, 15, 9))
    prompt_lens, arrival_step, budget = (30, 11, 6), (0, 0, 2), 12
    book = paged_cache_book(BLOCK_SIZE, num_blocks=24, max_blocks_per_seq=12, seed=3)
    kv_cache = init_kv_cache(config, book.num_blocks, BLOCK_SIZE)
    graphdef, state = nnx.split(model)
    fed, step, rows = [0, 0, 0], 0, []  # rows: (sequence, position, logits)
    chunk_lens = [[], [], []]
    while any(f < len(s) for f, s in zip(fed, streams, strict=True)):
        chunks, room = [], budget
        for i, stream in enumerate(streams):
            if step < arrival_step[i] or fed[i] == len(stream) or room == 0:
                continue
            take = min(prompt_lens[i] - fed[i], room) if fed[i] < prompt_lens[i] else 1
            chunks.append((i, stream[fed[i] : fed[i] + take]))
            chunk_lens[i].append(take)
            fed[i] += take
            room -= take
        input_ids, metadata = book.step(chunks, num_tokens=budget, num_seqs=4)
        logits, kv_cache = model_step(graphdef, state, input_ids, kv_cache, metadata)
        rows += [(i, fed[i] - 1, np.asarray(logits[row])) for row, (i, _) in enumerate(chunks)]
        step += 1
    oracle = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                               dtype=torch.float32)
    expected = [fed_logits(oracle, s, lens) for s, lens in zip(streams, chunk_lens, strict=True)]
    for i, position, got in rows:
        np.testing.assert_allclose(got, expected[i][position], atol=1e-4, rtol=0,
                                   err_msg=f"sequence {i} at position {position}")
    assert len(rows) > sum(len(s) - p for s, p in zip(streams, prompt_lens, strict=True))


def test_mistral_sees_only_its_window(tiny_mistral_dir, paged_cache_book):
    """The tiny Mistral's window (8) decides its logits past position 8: transformers
    without the window gives others, and jpaged gives transformers' windowed ones."""
    model, config, _ = load_model(tiny_mistral_dir)
    assert config.layer_windows == (8,) * config.num_layers
    prompt = random_tokens(np.random.default_rng(4), config.vocab_size, (30,))[0]
    book = paged_cache_book(BLOCK_SIZE, num_blocks=16, max_blocks_per_seq=8)
    input_ids, metadata = book.step([(0, prompt)], num_tokens=32, num_seqs=2)
    logits, _ = model_step(*nnx.split(model), input_ids,
                           init_kv_cache(config, book.num_blocks, BLOCK_SIZE), metadata)
    unwindowed = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_mistral_dir, dtype=torch.float32, sliding_window=None)
    with torch.no_grad():
        full = unwindowed(torch.tensor([prompt])).logits[0, -1].numpy()
    ours = np.asarray(logits[0])
    np.testing.assert_allclose(ours, oracle_logits(tiny_mistral_dir, prompt)[-1], atol=1e-4,
                               rtol=0)
    assert np.abs(ours - full).max() > 1e-2


def test_bfloat16_parameters_track_float32_oracle(tiny_llama_dir, paged_cache_book):
    model, config, _ = load_model(tiny_llama_dir, dtype=jnp.bfloat16)
    prompts = random_tokens(np.random.default_rng(2), config.vocab_size, (3, 17))
    book = paged_cache_book(BLOCK_SIZE, num_blocks=16, max_blocks_per_seq=8)
    input_ids, metadata = book.step(list(enumerate(prompts)), num_tokens=32, num_seqs=2)
    kv_cache = init_kv_cache(config, book.num_blocks, BLOCK_SIZE, jnp.bfloat16)

    logits, kv_cache = model_step(*nnx.split(model), input_ids, kv_cache, metadata)

    assert logits.dtype == jnp.float32 and kv_cache[0].dtype == jnp.bfloat16
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(nnx.state(model)))
    expected = np.stack([oracle_logits(tiny_llama_dir, p)[-1] for p in prompts])
    scale = np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(logits), expected, atol=0.03 * scale, rtol=0)


def test_jitted_step_donates_the_kv_cache(tiny_qwen2_dir, paged_cache_book):
    model, config, _ = load_model(tiny_qwen2_dir)
    book = paged_cache_book(BLOCK_SIZE, num_blocks=8, max_blocks_per_seq=4)
    input_ids, metadata = book.step([(0, [5, 6, 7])], num_tokens=4, num_seqs=1)
    kv_cache = init_kv_cache(config, book.num_blocks, BLOCK_SIZE)

    _, new_caches = model_step(*nnx.split(model), input_ids, kv_cache, metadata)

    assert all(a.is_deleted() for a in kv_cache)
    assert all(not a.is_deleted() for a in new_caches)


def test_config_reads_transformers_configs():
    llama = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=7,
        eos_token_id=[8, 9],
        rope_scaling={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 512},
    )
    config = LlamaConfig.from_hf_config(llama)
    shape = (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (3, 8, 2, 32)
    assert (config.rope_theta, config.rms_norm_eps) == (5e5, 1e-5)
    assert config.max_position_embeddings == 4096
    assert config.tie_word_embeddings and not config.attention_bias
    assert (config.bos_token_id, config.eos_token_ids) == (7, (8, 9))
    assert config.rope_scaling.factor == 8.0
    assert config.rope_scaling.original_max_position_embeddings == 512

    qwen2 = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    qwen = LlamaConfig.from_hf_config(qwen2)
    assert qwen.attention_bias and qwen.rope_scaling is None and qwen.head_dim == 16


def test_config_reads_transformers4_rope_fields():
    legacy = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 123.0,
              "rope_scaling": {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 2.0, "original_max_position_embeddings": 64}}
    config = LlamaConfig.from_hf_config(legacy)
    assert config.rope_theta == 123.0 and config.rope_scaling.factor == 2.0
    assert config.num_kv_heads == 2 and config.head_dim == 4


def test_gemma3_configs_of_both_transformers_give_one_config():
    """transformers 4 wrote Gemma 3's local RoPE as rope_local_base_freq beside a global
    rope_scaling, and no layer_types (five sliding layers, then a global one); 5 nests
    rope_parameters by layer type and lists layer_types."""
    common = {"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 7, "num_attention_heads": 2,
              "sliding_window": 4, "query_pre_attn_scalar": 4}
    legacy = LlamaConfig.from_hf_config(common | {
        "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    layer_types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    current = LlamaConfig.from_hf_config(common | {"layer_types": layer_types, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}})
    assert legacy == current
    assert current.layer_windows == (4,) * 5 + (None, 4)
    assert (current.local_rope_theta, current.rope_theta) == (1e4, 1e6)
    assert current.rope_scaling.factor == 8.0 and current.qk_norm


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
])
def test_rope_frequencies_match_transformers(rope):
    hf = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_scaling=rope)
    expected = LlamaRotaryEmbedding(hf).inv_freq.numpy()
    ours = rope_inverse_frequencies(LlamaConfig.from_hf_config(hf))
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be >= 1"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"model_type": "gemma2", "layer_types": ["full_attention"] * 3},
     r"layer_types has 3 entries for 1 layers"),
    ({"model_type": "gemma2", "layer_types": ["chunked_attention"], "sliding_window": 4},
     r"layer_types \['chunked_attention'\] are not supported"),
    ({"model_type": "gemma2", "sliding_window": 0}, "sliding_window must be >= 1"),
])
def test_config_rejects_unsupported_architectures(change, message):
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config({**base, **change})


def test_init_kv_caches_layout():
    config = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=6)
    k_cache, v_cache = init_kv_cache(config, num_blocks=5, block_size=3, dtype=jnp.bfloat16)
    for cache in (k_cache, v_cache):
        chex.assert_shape(cache.values, (3, 2, 5, 3, 6))
        assert cache.dtype == jnp.bfloat16 and cache.scales is None
        assert not np.asarray(as_float(cache)).any()
