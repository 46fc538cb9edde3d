"""Figure 16's workload: English-to-German translation behind a shared few-shot prefix.

The paper (Section 6.4) serves LLaMA-13B translating WMT16 English sentences behind a
1-shot (80-token) or 5-shot (341-token) instruction prefix. Here the prefix is real
text: an instruction of our own and one or five English-German example pairs of our
own, which the served model's tokenizer counts (`prefix_token_ids`; sized to land near
the paper's counts with SmolLM2's tokenizer).

WMT16 is not available offline, so each request's sentence is an assumption: uniform
random token ids of a log-normal length (`SentenceLengths`, median 26 tokens: about the
length of a news sentence), put in the prefix's own template ("English: ...",
"German:") after the prefix. A translation is about as long as its source, so a
request's output is as long as its sentence. Arrivals are a Poisson process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from experiments.workloads import RequestSpec, arrival_times

INSTRUCTION = ("Translate each English sentence below into German. Keep all names and "
               "numbers as they are, and answer with the German sentence only.")
EXAMPLES = (
    ("The new bridge over the river will open to traffic next spring.",
     "Die neue Brücke über den Fluss wird im nächsten Frühjahr für den Verkehr freigegeben."),
    ("Prices for heating oil rose by almost ten percent last month, the statistics office "
     "said on Tuesday.",
     "Die Preise für Heizöl sind im vergangenen Monat um fast zehn Prozent gestiegen, "
     "teilte das Statistikamt am Dienstag mit."),
    ("The government wants to build more schools and hospitals in rural areas over the "
     "next five years.",
     "Die Regierung will in den nächsten fünf Jahren mehr Schulen und Krankenhäuser in "
     "ländlichen Gebieten bauen."),
    ("After the match, the coach thanked the fans for their patience this season.",
     "Nach dem Spiel dankte der Trainer den Fans für ihre Geduld in dieser Saison."),
    ("Scientists at a university in Berlin say they have found traces of frozen water "
     "beneath the surface of the red planet.",
     "Wissenschaftler einer Berliner Universität sagen, sie hätten Spuren von gefrorenem "
     "Wasser unter der Oberfläche des roten Planeten gefunden."),
)
SHOTS = {"one-shot": 1, "five-shot": 5}
SOURCE_LABEL, TARGET_LABEL = "English: ", "\nGerman:"


def prefix_text(prefix: str) -> str:
    """The instruction and the first SHOTS[prefix] example pairs, each in the template
    a request's sentence then follows."""
    pairs = "".join(f"{SOURCE_LABEL}{english}{TARGET_LABEL} {german}\n\n"
                    for english, german in EXAMPLES[:SHOTS[prefix]])
    return f"{INSTRUCTION}\n\n{pairs}"


@dataclass(frozen=True)
class TranslationPrompts:
    """A prefix's token ids and the template's, as one tokenizer reads them. A prompt
    is prefix + source label + sentence + target label, concatenated as ids so that
    every prompt starts with the very same prefix ids (tokenizing the joined text
    could merge tokens across the seams)."""

    prefix: str
    prefix_ids: tuple[int, ...]
    source_label_ids: tuple[int, ...]
    target_label_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer, prefix: str) -> TranslationPrompts:
        """tokenizer: anything with encode(text, add_special_tokens=...) -> ids."""
        if prefix not in SHOTS:
            raise ValueError(f"prefix must be one of {sorted(SHOTS)}, got {prefix!r}")

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(prefix, ids(prefix_text(prefix)), ids(SOURCE_LABEL), ids(TARGET_LABEL))

    @property
    def template_len(self) -> int:
        """Tokens a prompt adds to its sentence past the prefix."""
        return len(self.source_label_ids) + len(self.target_label_ids)


@dataclass(frozen=True)
class SentenceLengths:
    """An assumed distribution of a source sentence's tokens: log-normal with this
    median and sigma, rounded and clipped to [low, high]."""

    median: float = 26.0
    sigma: float = 0.45
    low: int = 6
    high: int = 96

    def sample(self, num: int, rng: np.random.Generator) -> np.ndarray:
        """int64 [num]."""
        lengths = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(num)))
        return np.clip(lengths, self.low, self.high).astype(np.int64)


def translation_workload(prompts: TranslationPrompts, num_requests: int, *, vocab_size: int,
                         request_rate: float = math.inf, seed: int = 0,
                         lengths: SentenceLengths = SentenceLengths()) -> list[RequestSpec]:
    """num_requests translations behind prompts' prefix, each sentence `lengths` random
    token ids in [0, vocab_size), its output as long. The same lengths and tokens at
    every rate (arrivals drawn last)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    sentence_lens = lengths.sample(num_requests, rng)
    sentences = [tuple(rng.integers(0, vocab_size, n).tolist()) for n in sentence_lens]
    arrivals = arrival_times(num_requests, request_rate, rng)
    return [
        RequestSpec(f"{prompts.prefix}-{i}", float(arrivals[i]),
                    prompts.prefix_ids + prompts.source_label_ids + sentence
                    + prompts.target_label_ids,
                    output_len=len(sentence))
        for i, sentence in enumerate(sentences)
    ]
