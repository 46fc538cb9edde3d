"""SpeculativeConfig: how proposals are made, checked before any weights load."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

SpeculativeMethod = Literal["ngram", "draft_model"]
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, for the methods jpaged runs.

    method: "ngram" proposes the tokens that followed an earlier occurrence of a
            sequence's last n tokens (prompt_lookup_max >= n >= prompt_lookup_min,
            longest first) in its own prompt and output (jpaged.speculative.ngram);
            "draft_model" runs `model`, a smaller model with the target's vocabulary,
            autoregressively (jpaged.speculative.draft_model).
    num_speculative_tokens: k, the most tokens proposed per sequence and step.
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, "
                             f"got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config['model'] is for method 'draft_model'; "
                                 "method 'ngram' proposes from the sequence itself")
            lookup_max = self.prompt_lookup_max
            lookup_min = self.prompt_lookup_min
            if lookup_max is None:
                lookup_max = max(DEFAULT_LOOKUP_MAX, lookup_min or 1)
            if lookup_min is None:
                lookup_min = min(DEFAULT_LOOKUP_MIN, lookup_max)
            _check_int("prompt_lookup_min", lookup_min, 1)
            _check_int("prompt_lookup_max", lookup_max, 1)
            if lookup_min > lookup_max:
                raise ValueError(f"speculative_config['prompt_lookup_min']={lookup_min} is "
                                 f"above prompt_lookup_max={lookup_max}")
            object.__setattr__(self, "prompt_lookup_min", lookup_min)
            object.__setattr__(self, "prompt_lookup_max", lookup_max)
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config['model'] must name the draft model (a path "
                             f"or a model name) for method 'draft_model', got {self.model!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config[{name!r}] is for method 'ngram'")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict form (or as it is); ValueError naming a field it
        does not know."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; it takes "
                             f"{sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config needs {name!r}")
        return cls(**value)


# Unset prompt lookup bounds: n-grams of 5 down to 2 tokens. One token matches too
# often to propose well; longer n-grams rarely match outside copied text.
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 5


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config[{name!r}] must be an int, got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"speculative_config[{name!r}] must be >= {minimum}, got {value}")
