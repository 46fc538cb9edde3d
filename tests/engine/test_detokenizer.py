"""Incremental detokenization and stop strings.

Oracle for the detokenizer: the tokenizer's own decode of the whole output. After k
appends, `text` must equal decode(output[:k]) without its trailing U+FFFD characters
(the bytes of a character still incomplete, which later tokens may complete); after
`finish` it must equal decode(output). For stop strings: hand-written expectations,
and a character-by-character oracle that any chunking of the text must agree with.
"""

from __future__ import annotations

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jpaged.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopMatch,
    find_stop_string,
    held_back_length,
)
from jpaged.model.loader import default_model_directory
from tests.plugins.hf_models import END_OF_TEXT, tiny_tokenizer

TINY = tiny_tokenizer()
MULTILINGUAL = [
    "Grüße aus Köln, ça va? Ünïcödé",
    "東京の天気は晴れです。中文测试，标点！",
    "Привет, мир! Γειά σου Κόσμε",
    "مرحبا بالعالم — שלום עולם",
    "emoji 😀👍🏽👨‍👩‍👧 and music 𝄞𝄢 € £ ¥",
    "हिन्दी, 한국어 텍스트, ไทย",
]


@pytest.fixture(scope="module")
def smollm2():
    """The default model's tokenizer only (byte-level BPE, 49152 tokens)."""
    return transformers.AutoTokenizer.from_pretrained(default_model_directory())


def byte_ids(data: bytes) -> list[int]:
    """One tiny-tokenizer token per byte."""
    pieces = bytes_to_unicode()
    return TINY.convert_tokens_to_ids([pieces[b] for b in data])


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def assert_tracks_decode(tokenizer, prompt: list[int], output: list[int],
                         skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """Append `output` token by token, checking `text` and each delta against decode."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    for k, token in enumerate(output, start=1):
        before = detok.text
        delta = detok.append(token)
        expected = decode(tokenizer, output[:k], skip_special_tokens).rstrip(REPLACEMENT_CHAR)
        assert detok.text == expected
        assert detok.text == before + delta
    detok.finish()
    assert detok.text == decode(tokenizer, output, skip_special_tokens)
    return detok


# Partial characters.


@pytest.mark.parametrize("char", ["é", "€", "中", "𝄞", "😀"])
def test_partial_character_is_held_until_complete(char):
    ids = byte_ids(char.encode())
    assert len(ids) == len(char.encode()) >= 2
    detok = IncrementalDetokenizer(TINY, TINY.encode("price: "))
    assert [detok.append(t) for t in ids] == [""] * (len(ids) - 1) + [char]
    assert detok.append(TINY.encode("!")[0]) == "!"
    assert detok.text == char + "!"


def test_text_before_a_partial_character_is_shown(smollm2):
    """One token holds a space and the first three bytes of the emoji: the space shows
    at once, the emoji once its last byte arrives."""
    ids = smollm2.encode(" 😀")
    assert smollm2.convert_ids_to_tokens(ids) == ["ĠðŁĺ", "Ģ"]
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("Smile:"))
    assert [detok.append(t) for t in ids] == [" ", "😀"]


def test_finish_releases_bytes_that_never_complete_a_character():
    output = TINY.encode("ok ") + byte_ids("€".encode()[:2])
    detok = IncrementalDetokenizer(TINY, [])
    assert "".join(detok.append(t) for t in output) == "ok "
    assert detok.finish() == REPLACEMENT_CHAR
    assert detok.text == decode(TINY, output) == "ok " + REPLACEMENT_CHAR


def test_invalid_bytes_inside_the_text_are_shown_once_followed():
    output = byte_ids(b"a\xffb\xe2\x82c")
    detok = assert_tracks_decode(TINY, [], output)
    assert detok.text == "a\ufffdb\ufffdc"


# Random byte-token streams through the tiny byte-level tokenizer.

EOT_ID = TINY.convert_tokens_to_ids(END_OF_TEXT)
MERGE_IDS = list(range(256, EOT_ID))
token_runs = st.one_of(
    st.text(max_size=3).map(lambda s: byte_ids(s.encode())),
    st.binary(min_size=1, max_size=3).map(byte_ids),
    st.lists(st.integers(0x80, 0xFF), min_size=1, max_size=4).map(lambda b: byte_ids(bytes(b))),
    st.sampled_from(MERGE_IDS).map(lambda t: [t]),
    st.just([EOT_ID]),
)


@settings(max_examples=150, deadline=None)
@given(prompt=st.text(max_size=8), runs=st.lists(token_runs, max_size=12),
       skip_special_tokens=st.booleans())
def test_random_byte_tokens_track_full_decode(prompt, runs, skip_special_tokens):
    output = [t for run in runs for t in run]
    assert_tracks_decode(TINY, TINY.encode(prompt), output, skip_special_tokens)


# The default model's tokenizer.


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multilingual_text_round_trips_token_by_token(smollm2, text):
    output = smollm2.encode(text)
    detok = assert_tracks_decode(smollm2, smollm2.encode("Say it again:"), output)
    assert detok.text == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_in_the_output(smollm2, skip_special_tokens):
    im_end, end_of_text = smollm2.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    output = (smollm2.encode("Grüße 😀") + [im_end] + smollm2.encode(" 中文")
              + [end_of_text, end_of_text] + smollm2.encode("!"))
    detok = assert_tracks_decode(smollm2, smollm2.encode("<|im_start|>assistant\n"), output,
                                 skip_special_tokens)
    special = "<|im_end|>" if not skip_special_tokens else ""
    assert detok.text.startswith("Grüße 😀" + special + " 中文")


def test_prompt_context_keeps_a_sentencepiece_leading_space():
    """A Metaspace decoder drops the leading space of a decode's first token: with the
    prompt's last tokens as context the first output word keeps its space, as in the
    decode of the whole sequence."""
    words = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2, "<s>": 3},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Metaspace()
    words.decoder = decoders.Metaspace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>",
                                                     unk_token="<unk>")
    assert decode(tokenizer, [1]) == "world"
    for output in ([1], [3, 1], [1, 3, 0]):
        detok = IncrementalDetokenizer(tokenizer, [0])
        for t in output:
            detok.append(t)
        assert detok.text == decode(tokenizer, [0] + output)[len("Hello"):]
    assert detok.text == " world Hello"


# Fork.


def test_forks_diverge_independently():
    prompt = TINY.encode("Total: ")
    common = TINY.encode("12 ") + byte_ids(b"\xe2")  # "€" begun, not complete
    parent = IncrementalDetokenizer(TINY, prompt)
    for t in common:
        parent.append(t)
    child = parent.fork()
    tails = {parent: byte_ids(b"\x82\xac") + TINY.encode(" net"),
             child: TINY.encode("x gross")}
    for detok, tail in tails.items():
        for t in tail:
            detok.append(t)
    assert parent.text == decode(TINY, common + tails[parent]) == "12 € net"
    assert child.text == decode(TINY, common + tails[child]) == "12 \ufffdx gross"


# Cost.


class CountingTokenizer:
    """Wraps a tokenizer, counting decode calls and the tokens passed to them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0
        self.tokens = 0

    def decode(self, token_ids, **kwargs):
        self.calls += 1
        self.tokens += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


@pytest.mark.parametrize(
    "tokenizer_name", ["tiny", pytest.param("smollm2", marks=pytest.mark.default_model)]
)
def test_appending_n_tokens_decodes_o_of_n_tokens(tokenizer_name, request):
    tokenizer = TINY if tokenizer_name == "tiny" else request.getfixturevalue("smollm2")
    output = tokenizer.encode(" ".join(MULTILINGUAL * 12))
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("Prompt text here"))
    for t in output:
        detok.append(t)
    assert detok.text == decode(tokenizer, output)
    n = len(output)
    assert n > 1000
    assert counting.calls <= 2 * n + 1
    # A window is a few tokens: the last shown run plus the tokens of one character.
    assert counting.tokens <= 8 * n


# Stop strings: pure functions.


def test_find_stop_string_cuts_before_or_after_the_stop():
    assert find_stop_string("Hello world", 6, ["wor"]) == StopMatch(6, "wor")
    assert find_stop_string("Hello world", 6, ["wor"], True) == StopMatch(9, "wor")
    assert find_stop_string("Hello world", 6, ["xyz"]) is None


def test_find_stop_string_searches_only_where_new_text_completes_one():
    # "Hello" ended before the 3 new characters: it was checked when it arrived.
    assert find_stop_string("Hello world", 3, ["Hello"]) is None
    assert find_stop_string("Hello world", 3, ["o wor"]) == StopMatch(4, "o wor")
    assert find_stop_string("Hello world", 0, ["d"]) is None


def test_earliest_completed_stop_string_wins():
    # Whatever their order in the list.
    for stop in (["world", "llo"], ["llo", "world"]):
        assert find_stop_string("Hello world", 11, stop) == StopMatch(2, "llo")
    # "c" completes before "abcd" does, though "abcd" starts first.
    assert find_stop_string("xxabcd", 4, ["abcd", "c"]) == StopMatch(4, "c")
    # Both complete at the same character: the longer one, starting first, is cut.
    assert find_stop_string("xxabc", 3, ["bc", "abc"]) == StopMatch(2, "abc")
    assert find_stop_string("xxabc", 3, ["bc", "abc"], True) == StopMatch(5, "abc")


def test_held_back_length():
    assert held_back_length("Hello wo", ["world"]) == 2
    assert held_back_length("Hello wo", ["world", "o wo!"]) == 4
    assert held_back_length("Hello wx", ["world"]) == 0
    assert held_back_length("abc", ["abc"]) == 0  # a whole stop string is a match instead
    assert held_back_length("", ["abc"]) == 0
    assert held_back_length("ab", ["x", "b"]) == 0


def stream_chunks(chunks: list[str], stop: list[str], include: bool):
    """The engine's loop over text chunks: (output text, matched stop or None, the
    visible text after each unfinished step)."""
    text, visible = "", []
    for chunk in chunks:
        text += chunk
        match = find_stop_string(text, len(chunk), stop, include)
        if match:
            return text[: match.cut], match.stop, visible
        visible.append(text[: len(text) - held_back_length(text, stop)])
    return text, None, visible


def first_stop_by_character(text: str, stop: list[str], include: bool):
    """Oracle: grow the text one character at a time; the first end position at which a
    stop string completes, and there the longest one."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=14),
       stop=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 14)), include=st.booleans())
def test_any_chunking_stops_like_character_by_character(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    output, matched, visible = stream_chunks(chunks, stop, include)
    assert (output, matched) == first_stop_by_character(text, stop, include)
    # Shown text only grows, never shows a stop string, and never runs past the output.
    for before, after in zip(visible, visible[1:], strict=False):
        assert after.startswith(before)
    for shown in visible:
        assert not any(s in shown for s in stop)
        assert output.startswith(shown)


# Stop strings through the detokenizer.


def stream_tokens(tokenizer, prompt: str, output: str, stop: list[str], include=False):
    """The engine's loop over the tokens of `output`: (final text, matched stop or None,
    the visible text after each unfinished step)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    visible = []
    for t in tokenizer.encode(output):
        delta = detok.append(t)
        match = find_stop_string(detok.text, len(delta), stop, include)
        if match:
            return detok.text[: match.cut], match.stop, visible
        visible.append(detok.text[: len(detok.text) - held_back_length(detok.text, stop)])
    detok.finish()
    return detok.text, None, visible


def test_stop_string_across_token_boundaries_and_hold_back(smollm2):
    # Tokens: Hello | Ġworld | , | Ġthis | Ġis | Ġthe | Ġend | ...
    text, matched, visible = stream_tokens(smollm2, "Q:", "Hello world, this is the end.",
                                           ["is the"])
    assert (text, matched) == ("Hello world, this ", "is the")
    # "is" could begin "is the": held back after "this" and "is", released after "this is".
    assert visible == ["Hello", "Hello world", "Hello world,", "Hello world, th",
                       "Hello world, this "]


def test_stop_string_inside_one_token(smollm2):
    assert stream_tokens(smollm2, "Q:", "Hello world!", ["orl"])[:2] == ("Hello w", "orl")
    assert stream_tokens(smollm2, "Q:", "Hello world!", ["orl"], True)[:2] == ("Hello worl",
                                                                               "orl")


def test_several_stop_strings_earliest_wins(smollm2):
    text, matched, _ = stream_tokens(smollm2, "Q:", "Hello world, this is the end.",
                                     ["the end", "world", "is"])
    assert (text, matched) == ("Hello ", "world")


def test_held_back_prefix_is_released_when_ruled_out():
    text, matched, visible = stream_tokens(TINY, "", "a wox", ["wor"])
    assert (text, matched) == ("a wox", None)
    assert visible == ["a", "a ", "a ", "a ", "a wox"]


def test_stop_string_longer_than_any_token():
    assert max(len(t) for t in TINY.get_vocab() if t != END_OF_TEXT) < len("the end")
    text, matched, visible = stream_tokens(TINY, "", "This is the end of it", ["the end"])
    assert (text, matched) == ("This is ", "the end")
    assert visible[-1] == "This is "  # "the en" was held back
    assert stream_tokens(TINY, "", "This is the end of it", ["the end"], True)[0] == (
        "This is the end")


def test_no_stop_shows_everything_after_finish():
    text, matched, visible = stream_tokens(TINY, "", "ending with a wo", ["wor"])
    assert (text, matched) == ("ending with a wo", None)
    assert visible[-1] == "ending with a "
