"""The model's tokenizer and chat template, read without transformers or PyTorch.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library behind Hugging Face's
fast tokenizers) and renders the chat template with jinja2 in a sandbox, as
transformers does. It comes from
- a Hugging Face directory: tokenizer.json, with special tokens and the chat
  template from tokenizer_config.json, special_tokens_map.json, chat_template.jinja
  or chat_template.json;
- a GGUF file's `tokenizer.ggml.*` metadata, rebuilt the way transformers rebuilds it:
  llama.cpp's "gpt2" tokenizer model, a byte-level BPE (tokens spelled in GPT-2's byte
  alphabet, merges, token types); or Gemma's SentencePiece BPE (tokenizer model "llama"
  in a "gemma3" file: "▁" for spaces, byte fallback, no merges stored).

Its methods keep transformers' names and meanings: `encode`, `decode`,
`apply_chat_template`, `convert_tokens_to_ids`, `convert_ids_to_tokens`, `len()`,
`save_pretrained`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# llama.cpp's token types (`tokenizer.ggml.token_type`).
CONTROL, USER_DEFINED = 3, 4
# Text splits before byte-level BPE, by `tokenizer.ggml.pre`, for the pre-tokenizers that
# differ from GPT-2's (the default): Llama 3's and Qwen2's published patterns.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF architectures whose "llama" (SentencePiece) vocabulary is Gemma's.
GEMMA_GGUF_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# SentencePiece's word-boundary mark, which stands for a space in its vocabularies.
SPACE_MARK = "\u2581"
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


# Marks where the final message's content ends in a rendered chat (continue_final_message).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


NO_CHAT_TEMPLATE = (
    "this model's tokenizer has no chat template: give one (LLM.chat(chat_template=...), "
    "--chat-template FILE for python -m jpaged chat / serve) or send the prompt as plain "
    "text (LLM.generate, python -m jpaged generate --raw)")


class TokenizerError(ValueError):
    """Tokenizer files or metadata that describe no tokenizer jpaged can build."""


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text.

    backend: the tokenizers.Tokenizer (pre-tokenizer, model, decoder, added tokens);
    special_tokens: "bos_token", "eos_token", "unk_token", "pad_token" -> token text
    (absent when the model has none); chat_template: jinja2 source or None;
    add_bos_token / add_eos_token: whether encode adds BOS / EOS (None: the backend's
    own post-processor decides).
    """

    def __init__(self, backend: BackendTokenizer, special_tokens: Mapping[str, str], *,
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None):
        self.backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        missing = [AddedToken(t, special=True, normalized=False)
                   for t in self.special_tokens.values() if backend.token_to_id(t) is None]
        backend.add_special_tokens(missing)
        if add_bos_token is not None or add_eos_token is not None:
            backend.post_processor = self._bos_eos_template()

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory (tokenizer.json required)."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{directory} has no tokenizer.json; jpaged reads fast tokenizers only (convert "
                "a slow one with transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d))"
            )
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        legacy_map = _read_json(directory / "special_tokens_map.json")
        special = {name: _token_text(config.get(name, legacy_map.get(name)))
                   for name in SPECIAL_TOKEN_NAMES}
        # tokenizer.json's post-processor decides BOS/EOS, as in transformers: the
        # add_bos_token / add_eos_token flags beside it were applied when it was written.
        return cls(backend, special, chat_template=_chat_template(directory, config))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF's metadata describes (key -> value, as gguf reads them)."""
        model = metadata.get("tokenizer.ggml.model")
        arch = metadata.get("general.architecture")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [])
        if model == "gpt2":
            backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [],
                                      metadata.get("tokenizer.ggml.pre"))
            add_bos_default = False
        elif model == "llama" and arch in GEMMA_GGUF_ARCHITECTURES:
            backend = _gemma_sentencepiece_bpe(tokens)
            add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise TokenizerError(
                f"GGUF tokenizer model {model!r} (architecture {arch!r}) is not supported; "
                "jpaged reads 'gpt2' (byte-level BPE) tokenizers and Gemma's 'llama' "
                "(SentencePiece) ones: load the model's Hugging Face directory instead"
            )
        _add_marked_tokens(backend, tokens, token_types, byte_level=model == "gpt2")
        ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
               "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
        special = {name: tokens[metadata[f"tokenizer.ggml.{key}"]] for name, key in ids.items()
                   if f"tokenizer.ggml.{key}" in metadata}
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)
        return cls(backend, special, chat_template=metadata.get("tokenizer.chat_template"),
                   add_bos_token=bool(add_bos),
                   add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS/EOS where the model asks for them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (GPT-2's byte alphabet for byte-level
        BPE); None outside the vocabulary."""
        return [self.backend.id_to_token(token_id) for token_id in token_ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(token) for token in tokens]

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            chat_template: str | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """The conversation rendered by the chat template: its text, or (tokenize=True)
        that text's token ids, without adding BOS/EOS (the template writes them).

        continue_final_message: the text ends where the last message's content ends, so
        generation continues it (what the template writes after it, the end of its turn,
        is cut), as in transformers. chat_template: jinja2 source used instead of the
        tokenizer's own. template_kwargs: more template variables (over the special
        tokens of the same names).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        messages = [dict(message) for message in messages]
        if continue_final_message:
            messages[-1]["content"] += CONTINUE_TAG
        text = _compiled_template(template).render(
            **(self.special_tokens | template_kwargs), messages=messages,
            add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            text = _cut_at_tag(text)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja, files both
        `Tokenizer.from_directory` and transformers' AutoTokenizer read."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        flags = {"add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token}
        config.update({name: flag for name, flag in flags.items() if flag is not None})
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if self.chat_template is not None:
            (directory / "chat_template.jinja").write_text(self.chat_template)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def _bos_eos_template(self) -> processors.TemplateProcessing:
        """BOS before and EOS after each sequence as the flags ask (a flag whose token the
        model lacks is ignored), as transformers builds it from the same flags."""
        bos = self.special_tokens.get("bos_token") if self.add_bos_token else None
        eos = self.special_tokens.get("eos_token") if self.add_eos_token else None
        single = " ".join([f"{bos}:0"] * bool(bos) + ["$A:0"] + [f"{eos}:0"] * bool(eos))
        pair = " ".join([single] + [f"{bos}:1"] * bool(bos) + ["$B:1"] + [f"{eos}:1"] * bool(eos))
        special = [(t, self.backend.token_to_id(t)) for t in (bos, eos) if t]
        return processors.TemplateProcessing(single=single, pair=pair,
                                             special_tokens=list(dict.fromkeys(special)))


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled
    in: printable Latin-1 bytes stand for themselves, the other 68 bytes for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _byte_level_bpe(tokens: list[str], merges: Sequence[str], pre: str | None
                    ) -> BackendTokenizer:
    alphabet = set(byte_alphabet().values())
    spell = byte_alphabet()
    # A token spelled outside the byte alphabet (an added token with a real space, say)
    # is looked up by its bytes' spelling.
    vocab = {token if set(token) <= alphabet else "".join(spell[b] for b in token.encode()): i
             for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma_sentencepiece_bpe(tokens: list[str]) -> BackendTokenizer:
    """Gemma's SentencePiece BPE from its GGUF vocabulary: spaces become SPACE_MARK before
    BPE, unknown characters fall back to their <0xNN> byte tokens, and the decoder undoes
    both.

    llama.cpp spells the tokens made only of spaces with real spaces; they are respelled
    with SPACE_MARK, as the text they match is. The file stores no merges: every split of a
    token into two vocabulary tokens is a merge, ranked by the token's position in the
    file (earlier first: Gemma's scores do not follow its merge order, its positions do),
    and among the splits of one token the longer left part first, as transformers orders
    them.
    """
    spelled = [SPACE_MARK * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}
    merges = [
        (token[:cut], token[cut:])
        for token in sorted(vocab, key=vocab.__getitem__)
        for cut in range(len(token) - 1, 0, -1)
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token="<unk>",
                                   fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "),
                                         decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _add_marked_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int],
                       byte_level: bool) -> None:
    """Keep control tokens (special) and user-defined ones (plain) whole in the text.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    mislabelled byte sequence in llama.cpp's files; adding it would grow the vocabulary
    past the model's, so it is left.
    """
    alphabet = set(byte_alphabet().values())
    vocab = backend.get_vocab()
    typed = list(zip(tokens, token_types, strict=False))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in typed
                                if kind == CONTROL and (not byte_level or set(t) <= alphabet)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in typed
                        if kind == USER_DEFINED and t in vocab])


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{file} is not valid JSON ({error})") from error


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: text, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's (a named list's "default"),
    else chat_template.json's."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = config.get("chat_template",
                          _read_json(directory / "chat_template.json").get("chat_template"))
    if isinstance(template, list):
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to CONTINUE_TAG, where the final message's content ended; a
    template that trimmed the tag's space trimmed the content's trailing space too."""
    end = text.rfind(CONTINUE_TAG.strip())
    if end < 0:
        raise ValueError("continue_final_message is set but the chat template does not "
                         "write the final message's content")
    return text[:end] if text.startswith(CONTINUE_TAG, end) else text[:end].rstrip()


@lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    """A chat template compiled in jinja2's immutable sandbox (templates come with
    downloaded models), with the helpers Hugging Face templates call."""
    def raise_exception(message: str):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
    # jinja2's own tojson escapes HTML; templates expect plain JSON.
    environment.filters["tojson"] = (
        lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False:
        json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                   sort_keys=sort_keys))
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return environment.from_string(source)
