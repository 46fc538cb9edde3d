"""LoRARequest: which adapter a request runs with (vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

from jpaged.errors import InvalidParameter, InvalidParameterType


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter for a request: `lora_name` names it (the prefix cache, `/v1/models`),
    `lora_int_id` (>= 1; 0 is the base model) identifies it as in vLLM, `lora_path` is
    the directory holding adapter_config.json and adapter_model.safetensors."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidParameterType(
                    f"lora_request.{name}",
                    f"lora_request.{name} must be a non-empty str, got {value!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise InvalidParameterType("lora_request.lora_int_id",
                                       f"lora_request.lora_int_id must be an int, got "
                                       f"{self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise InvalidParameter("lora_request.lora_int_id",
                                   f"lora_request.lora_int_id must be >= 1 (0 is the base "
                                   f"model), got {self.lora_int_id}")
