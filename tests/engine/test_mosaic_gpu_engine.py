"""The engine on the Mosaic GPU kernel (in Mosaic GPU interpret mode on the CPU, jax >= 0.12)
against transformers' greedy `generate` on a tiny bfloat16 Llama whose head_dim (64) the
kernel takes; and the default kernel handing over to Triton where it cannot run."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import oracle_torch, oracle_transformers, randomize, tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode (jax >= 0.12 has)")

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_llama_dir(tmp_path_factory):
    """Two layers, two query heads over one KV head of head_dim 64, saved in bfloat16."""
    torch, transformers = oracle_torch(), oracle_transformers()
    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    model = randomize(transformers.LlamaForCausalLM(config), seed=3).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("bf16_llama")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _transformers_greedy(model_dir, prompts) -> list[list[int]]:
    torch, transformers = oracle_torch(), oracle_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def _llm(loaded, **kwargs) -> LLM:
    config = dict(dtype="bfloat16", block_size=16, num_blocks=32, max_num_seqs=4,
                  max_num_batched_tokens=64, max_model_len=128,
                  persistent_compilation_cache=False)
    return LLM("tiny-bf16", loaded=loaded, **(config | kwargs))


@pytest.mark.full
def test_greedy_outputs_equal_transformers_in_bfloat16(bf16_llama_dir):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 263, n).tolist() for n in (5, 23)]
    llm = _llm(load_model(bf16_llama_dir), attention_backend="mosaic_gpu", interpret=True)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == _transformers_greedy(bf16_llama_dir,
                                                                              prompts)


def test_requested_without_a_hopper_gpu_names_why(bf16_llama_dir):
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU's refusal")
    with pytest.raises(RuntimeError, match="attention_backend='mosaic_gpu'.*needs a GPU"):
        _llm(load_model(bf16_llama_dir), attention_backend="mosaic_gpu")


def test_the_default_hands_over_to_triton_where_the_layout_does_not_fit(bf16_llama_dir,
                                                                        monkeypatch, caplog):
    """A float32 cache (the model's dtype) is not the kernel's: Triton takes over, said at
    info level (float32, the default dtype, is Triton's by design, not a failure)."""
    monkeypatch.setattr("jpaged.engine.backend_choice.device_attention_backend",
                        lambda: "mosaic_gpu")
    with caplog.at_level(logging.INFO, logger="jpaged"):
        llm = _llm(load_model(bf16_llama_dir), dtype="float32", interpret=True)
    assert llm.engine.runner.attention_backend == "triton"
    (handover,) = [r for r in caplog.records if "float16 or bfloat16 pages" in r.getMessage()]
    assert handover.levelno == logging.INFO
