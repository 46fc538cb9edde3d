"""Random PEFT adapters of a tiny model on disk, and PEFT's answers with them: the oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.plugins.hf_models import oracle_torch, oracle_transformers

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ATTENTION_AND_MLP = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def peft_model(base_dir: Path, rank: int, targets: list[str], seed: int, **options):
    """transformers' model of `base_dir` with a random LoRA adapter (init_lora_weights=False:
    B is not zero, so the adapter changes the output)."""
    import peft

    torch = oracle_torch()
    torch.manual_seed(seed)
    model = oracle_transformers().AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False, **options)
    return peft.get_peft_model(model, config).eval()


def save_adapter(base_dir: Path, directory: Path, rank: int, targets: list[str], seed: int,
                 **options) -> Path:
    peft_model(base_dir, rank, targets, seed, **options).save_pretrained(directory)
    return directory


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    torch = oracle_torch()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    """f32 [len(prompt), vocab]: log-softmax of the logits at each prompt position."""
    torch = oracle_torch()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()
