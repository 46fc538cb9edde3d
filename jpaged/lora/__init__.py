"""Multi-LoRA serving: vLLM's `LoRARequest`, PEFT adapters read and checked on the host,
and the table of adapter slots the scheduler hands out (the device holds the slots:
`jpaged.model.llama.LoRAWeight`)."""

from jpaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
