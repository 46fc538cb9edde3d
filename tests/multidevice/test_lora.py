"""LoRA adapters under tensor and data parallelism, against one device: under tensor
parallelism each device holds its shard of the low-rank factors (B's columns of q/k/v
and gate/up, A's rows of o and down, as their kernels split); under data parallelism
each replica loads the adapters its requests name into its own slots. A batch mixing two
adapters and the base model gives the one-device engine's greedy tokens (itself checked
against PEFT in tests/lora), up to near ties."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.engine.stats import num_compilations
from jpaged.model.loader import read_model_config
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


@pytest.fixture(scope="module")
def batch(tiny_llama_dir):
    """Two prompts for the two adapters, the first again for the base model."""
    first, second = prompts(read_model_config(tiny_llama_dir).vocab_size, lengths=(5, 11))
    return [first, second, first]


def _generate(llm: LLM, batch: list, adapters: list[LoRARequest]):
    return llm.generate(batch, GREEDY, lora_request=[*adapters, None])


@pytest.fixture(scope="module")
def one_device(tiny_llama_dir, batch, adapters):
    outputs = _generate(LLM(str(tiny_llama_dir), **LORA, **ENGINE), batch, adapters)
    with_adapter, base = outputs[0].outputs[0], outputs[2].outputs[0]
    assert with_adapter.token_ids != base.token_ids, "the adapter changes nothing"
    return outputs


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_adapters_match_one_device(size, tiny_llama_dir, batch, adapters,
                                                   one_device):
    """4 query and 2 KV heads: TP 2 splits the KV heads, TP 4 replicates each on two
    devices (B's k and v columns are repeated as the kernel's are)."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=size, **LORA, **ENGINE)
    near_ties = near_ties_or_fail(one_device, _generate(llm, batch, adapters))
    print(f"TP={size} llama with adapters: {near_ties} near-tie steps")

    layer = llm.engine.runner.params["layers"]
    qkv_b = layer["self_attn"]["qkv_proj"]["lora_b"].get_value()
    o_a = layer["self_attn"]["o_proj"]["lora_a"].get_value()
    assert qkv_b.sharding.spec == P(None, None, None, "model")
    assert o_a.sharding.spec == P(None, None, "model", None)
    assert bytes_per_device(o_a) * size == o_a.nbytes


def test_data_parallel_replicas_load_their_requests_adapters(tiny_llama_dir, batch, adapters,
                                                           one_device):
    """Two replicas share out the batch: each loads the adapters of the requests it
    runs, and unloading reaches every replica."""
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, **LORA, **ENGINE)
    near_ties = near_ties_or_fail(one_device, _generate(llm, batch, adapters))
    print(f"DP=2 llama with adapters: {near_ties} near-tie steps")
    loads = [replica.adapters.num_loads for replica in llm.engine.replicas]
    assert all(loads) and sum(loads) == len(adapters)
    assert llm.engine.remove_lora(adapters[0].lora_name)
    held = [adapter.name for replica in llm.engine.replicas
            for adapter in [*replica.adapters.host_adapters, *replica.adapters.slot_adapters]
            if adapter is not None]
    assert adapters[0].lora_name not in held and adapters[1].lora_name in held


def test_warmup_leaves_nothing_to_compile(tiny_llama_dir, batch, adapters, one_device,
                                          no_compilation_cache):
    """TP 2 with async scheduling: warm-up compiles the steps for the input ids the
    sampler feeds them, what follows a step for the mesh's layout, and the slot writes;
    the adapters' factors are regrouped on the host. Serving then compiles nothing."""
    jax.clear_caches()  # the slot writes are one jit, which other engines here compiled
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, async_scheduling=True, **LORA,
              **ENGINE)
    llm.engine.warmup()
    assert jax.config.jax_compilation_cache_dir is None  # a hit would not count as a compile
    before = num_compilations()
    near_ties_or_fail(one_device, _generate(llm, batch, adapters))
    assert num_compilations() - before == 0
