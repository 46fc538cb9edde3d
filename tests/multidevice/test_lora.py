"""LoRA adapters under tensor parallelism, against one device: each device holds its
shard of the low-rank factors (B's columns of q/k/v and gate/up, A's rows of o and
down, as their kernels split), and a batch mixing two adapters and the base model gives
the one-device engine's greedy tokens (itself checked against PEFT in tests/lora), up to
near ties."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.model.sharding import bytes_per_device
from tests.lora.adapters import ATTENTION, ATTENTION_AND_MLP, save_adapter
from tests.multidevice.test_tensor_parallel import ENGINE, near_ties_or_fail, prompts

pytestmark = [pytest.mark.full, pytest.mark.filterwarnings("ignore::FutureWarning")]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_lora")
    return [LoRARequest(f"adapter{i}", i + 1,
                        str(save_adapter(tiny_llama_dir, root / f"a{i}", 8, targets, seed=i)))
            for i, targets in enumerate([ATTENTION_AND_MLP, ATTENTION])]


def _generate(llm: LLM, adapters: list[LoRARequest]):
    """Two prompts under the two adapters, the first again under the base model."""
    batch = prompts(llm.engine.model_config.vocab_size, lengths=(5, 11))
    return llm.generate([*batch, batch[0]], GREEDY, lora_request=[*adapters, None])


@pytest.fixture(scope="module")
def one_device(tiny_llama_dir, adapters):
    outputs = _generate(LLM(str(tiny_llama_dir), **LORA, **ENGINE), adapters)
    with_adapter, base = outputs[0].outputs[0], outputs[2].outputs[0]
    assert with_adapter.token_ids != base.token_ids, "the adapter changes nothing"
    return outputs


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_adapters_match_one_device(size, tiny_llama_dir, adapters, one_device):
    """4 query and 2 KV heads: TP 2 splits the KV heads, TP 4 replicates each on two
    devices (B's k and v columns are repeated as the kernel's are)."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=size, **LORA, **ENGINE)
    near_ties = near_ties_or_fail(one_device, _generate(llm, adapters))
    print(f"TP={size} llama with adapters: {near_ties} near-tie steps")

    layer = llm.engine.runner.params["layers"]
    qkv_b = layer["self_attn"]["qkv_proj"]["lora_b"].get_value()
    o_a = layer["self_attn"]["o_proj"]["lora_a"].get_value()
    assert qkv_b.sharding.spec == P(None, None, None, "model")
    assert o_a.sharding.spec == P(None, None, "model", None)
    assert bytes_per_device(o_a) * size == o_a.nbytes
