"""What an adapter directory may not hold: each refusal is a ValueError naming the file
and the field, raised before any engine state changes."""

from __future__ import annotations

import json
import shutil

import pytest

from jpaged.lora.peft import AdapterLoadError, read_adapter
from jpaged.lora.request import LoRARequest
from jpaged.model.loader import read_hf_config
from tests.lora.adapters import ATTENTION, save_adapter


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory):
    return save_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter") / "a", 8,
                        ATTENTION, seed=0)


def _variant(adapter, tmp_path, **changes):
    directory = tmp_path / "variant"
    shutil.copytree(adapter, directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("changes", "field"), [
    ({"use_dora": True}, "use_dora"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"target_modules": ".*proj"}, "target_modules"),
])
def test_unsupported_settings_are_refused(adapter, tmp_path, tiny_llama_dir, changes, field):
    directory = _variant(adapter, tmp_path, **changes)
    with pytest.raises(AdapterLoadError, match=field) as error:
        read_adapter(LoRARequest("a", 1, str(directory)), read_hf_config(tiny_llama_dir), 16)
    assert "adapter_config.json" in str(error.value)


def test_rank_above_max_lora_rank(adapter, tiny_llama_dir):
    with pytest.raises(ValueError, match=r"r=8 is above max_lora_rank=4"):
        read_adapter(LoRARequest("a", 1, str(adapter)), read_hf_config(tiny_llama_dir), 4)


def test_missing_files(adapter, tmp_path, tiny_llama_dir):
    directory = _variant(adapter, tmp_path)
    (directory / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors: no such file"):
        read_adapter(LoRARequest("a", 1, str(directory)), read_hf_config(tiny_llama_dir), 16)


def test_shapes_of_another_model(adapter, tiny_qwen3_dir):
    """An adapter of a Llama whose heads are 16 wide on a Qwen3 with heads 24 wide."""
    with pytest.raises(ValueError, match=r"adapter_model.safetensors.*lora_B.*has shape"):
        read_adapter(LoRARequest("a", 1, str(adapter)), read_hf_config(tiny_qwen3_dir), 16)


@pytest.mark.parametrize(("args", "field"), [
    (("", 1, "p"), "lora_name"), (("a", 0, "p"), "lora_int_id"),
    (("a", True, "p"), "lora_int_id"), (("a", 1, None), "lora_path")])
def test_lora_request_fields(args, field):
    with pytest.raises((TypeError, ValueError), match=field):
        LoRARequest(*args)
