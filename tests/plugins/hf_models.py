"""Tiny random Hugging Face models on disk, and transformers' answers on them: the oracle.

The tiny models are written by transformers itself, so loading them exercises the same
files a user would hand to jpaged. torch and transformers are imported only inside the
fixtures and helpers that use them, so that the host-only tests run without either.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    import torch
    import transformers

TINY_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "th"), ("i", "n"), ("e", "r"), ("Ġ", "a")]
END_OF_TEXT = "<|endoftext|>"
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@functools.cache
def oracle_torch():
    """torch, on one thread: on a CPU shared with other processes its spin-waiting thread
    pool otherwise slows the oracle down by an order of magnitude."""
    import torch

    torch.set_num_threads(1)
    return torch


def oracle_transformers():
    """transformers, its torch on one thread."""
    oracle_torch()
    import transformers

    return transformers


@pytest.fixture(scope="session", autouse=True)
def single_threaded_torch():
    """One thread also for the tests whose modules import torch themselves (at collection,
    before any fixture ran)."""
    if "torch" in sys.modules:
        oracle_torch()


def tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """Byte-level BPE: 256 byte tokens, a few merges, and <|endoftext|> (263 tokens)."""
    transformers = oracle_transformers()
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pieces = list(bytes_to_unicode().values()) + ["".join(m) for m in TINY_MERGES] + [END_OF_TEXT]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    return transformers.GPT2Tokenizer(vocab=vocab, merges=TINY_MERGES, unk_token=END_OF_TEXT,
                                      bos_token=END_OF_TEXT, eos_token=END_OF_TEXT)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter, biases and norm weights included, a random value, so that
    each of them changes the logits (transformers initializes biases to 0, norms to 1)."""
    torch = oracle_torch()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)
    return model.eval()


def _save(model, tokenizer, directory: Path, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Untied Llama 3 style model with llama3 RoPE scaling, saved as sharded safetensors."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), **TINY_SHAPE, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.LlamaForCausalLM(config), seed=0)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_llama"), max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2 model with q/k/v biases and tied embeddings, saved as one safetensors file."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), **TINY_SHAPE, tie_word_embeddings=True,
        rope_theta=1e6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.Qwen2ForCausalLM(config), seed=1)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3: per-head q/k RMSNorm before RoPE, a head_dim apart from hidden / heads."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), **(TINY_SHAPE | {"head_dim": 24}), tie_word_embeddings=True,
        rope_theta=1e6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.Qwen3ForCausalLM(config), seed=2)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    """Mistral: Llama with a sliding window of 8 tokens over every layer, which the tests'
    prompts and generations run past."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.MistralConfig(
        vocab_size=len(tokenizer), **TINY_SHAPE, sliding_window=8, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.MistralForCausalLM(config), seed=3)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_mistral"))


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory) -> Path:
    """Gemma 2: sliding (window 8) and global layers alternating, both soft-caps (low enough
    to bite on random weights), GeGLU, (1 + w) norms around attention and the MLP, scaled
    embeddings, query_pre_attn_scalar apart from head_dim."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer), **(TINY_SHAPE | {"num_hidden_layers": 4}), head_dim=16,
        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
    )
    model = randomize(transformers.Gemma2ForCausalLM(config), seed=4)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_gemma2"))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    """Gemma 3 (text): Gemma 2's layer plus (1 + w) q/k norms, a local RoPE base on the
    sliding layers (window 8) and linear RoPE scaling on the global ones. Four layers:
    layer_types given, or every layer would slide."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), **(TINY_SHAPE | {"num_hidden_layers": 4}), head_dim=16,
        sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e5}},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
    )
    model = randomize(transformers.Gemma3ForCausalLM(config), seed=5)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, RoPE over 3/4 of each head
    (Phi-4-mini's partial_rotary_factor), LongRoPE switching at 32 tokens (so sequences
    cross it mid-generation), a window of 12 over every layer."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    rotary_pairs = 6  # head_dim 16 * 0.75 / 2
    rng = np.random.default_rng(6)
    config = transformers.Phi3Config(
        vocab_size=len(tokenizer), **TINY_SHAPE, sliding_window=12, pad_token_id=0,
        original_max_position_embeddings=32, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": (1 + rng.random(rotary_pairs)).tolist(),
                      "long_factor": (2 + 4 * rng.random(rotary_pairs)).tolist()},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.Phi3ForCausalLM(config), seed=6)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_phi3"))


@pytest.fixture(scope="session", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
                                         "tiny_mistral_dir", "tiny_gemma2_dir",
                                         "tiny_gemma3_dir", "tiny_phi3_dir"])
def tiny_model_dir(request) -> Path:
    return request.getfixturevalue(request.param)


def greedy_continuations(model_dir: Path, prompts: list[list[int]], num_tokens: int
                         ) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly num_tokens long (EOS
    suppressed), one prompt at a time: the oracle for the engine's greedy outputs.
    Computed once per model, prompt and length in a run (several modules ask alike)."""
    key = (str(model_dir), num_tokens)
    known = _continuations.setdefault(key, {})
    missing = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in known))
    if missing:
        known.update(zip(missing, _generate_greedy(model_dir, missing, num_tokens),
                         strict=True))
    return [list(known[tuple(p)]) for p in prompts]


_continuations: dict[tuple[str, int], dict[tuple[int, ...], list[int]]] = {}


def _generate_greedy(model_dir: Path, prompts, num_tokens: int) -> list[list[int]]:
    torch, transformers = oracle_torch(), oracle_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                 pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def fed_logits(model, token_ids: list[int], chunk_lens: list[int]) -> np.ndarray:
    """f32 [len(token_ids), vocab]: a transformers model's logits when it is fed the tokens
    chunk by chunk through its KV cache, as an engine feeds them. For most models the
    chunks change nothing; a LongRoPE model's factors follow each forward call's largest
    position, so its oracle is fed as the engine is."""
    torch, transformers = oracle_torch(), oracle_transformers()
    cache, start, logits = transformers.DynamicCache(config=model.config), 0, []
    with torch.no_grad():
        for length in chunk_lens:
            positions = torch.arange(start, start + length)[None]
            out = model(torch.tensor([token_ids[start:start + length]]), position_ids=positions,
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits[0].float().numpy())
            start += length
    return np.concatenate(logits)


def transformers_answer(model_dir: Path, prompt: str, max_tokens: int) -> str:
    """Greedy decoding with transformers, stopped at EOS, decoded as the CLI prints it."""
    torch, transformers = oracle_torch(), oracle_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tokenizer(prompt).input_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
