"""Figure 17's synthetic conversations against their stated definition: rounds drawn as
said, each round's prompt its history cut to the last N tokens, outputs capped, and a
replay whose next round carries the model's own answer and arrives after it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from experiments.conversations import (
    Conversation,
    ConversationShape,
    Replay,
    chatbot_requests,
    make_conversations,
)
from experiments.workloads import DATASETS, fitted_locations


def test_rounds_and_turn_lengths_follow_the_stated_distributions():
    shape = ConversationShape(mean_rounds=4.0, max_rounds=10**6, scale=0.5, min_len=1)
    conversations = make_conversations(3000, vocab_size=50, seed=0, shape=shape)
    rounds = np.array([c.num_rounds for c in conversations])
    assert rounds.min() >= 1 and abs(rounds.mean() - 4.0) < 0.15  # geometric, mean 4
    answers = np.array([len(a) for c in conversations for a in c.answers])
    mu = fitted_locations("sharegpt")[1] + np.log(shape.scale)
    # The median of a log-normal is exp(mu); its log-spread is the ShareGPT-like sigma.
    assert abs(np.log(np.median(answers)) - mu) < 0.05
    assert abs(np.std(np.log(answers)) - DATASETS["sharegpt"].output_sigma) < 0.05
    capped = make_conversations(500, vocab_size=50, shape=ConversationShape(max_rounds=3))
    assert max(c.num_rounds for c in capped) == 3


def test_a_round_is_its_history_cut_to_the_last_tokens_with_its_answer_capped():
    conversation = Conversation("c", questions=((1, 2), (3,), (4, 5, 6)),
                                answers=((7, 8, 9), (10,), (11, 12, 13, 14)))
    assert conversation.history(0) == (1, 2)
    assert conversation.history(2) == (1, 2, 7, 8, 9, 3, 10, 4, 5, 6)
    requests = chatbot_requests([conversation], 3, prompt_cut=4, output_cap=3, seed=0)
    by_round = {r.request_id: r for r in requests}
    assert by_round["c-round-2"].prompt_token_ids == (10, 4, 5, 6)
    assert by_round["c-round-0"].prompt_token_ids == (1, 2)
    assert [by_round[f"c-round-{k}"].output_len for k in range(3)] == [3, 1, 3]


def test_chatbot_requests_are_distinct_rounds_in_every_conversation():
    conversations = make_conversations(30, vocab_size=100, seed=2)
    total = sum(c.num_rounds for c in conversations)
    requests = chatbot_requests(conversations, total, prompt_cut=64, output_cap=64, seed=1)
    assert len({r.request_id for r in requests}) == total
    assert all(len(r.prompt_token_ids) <= 64 and 1 <= r.output_len <= 64 for r in requests)


def test_the_replay_sends_the_models_answer_back_with_the_next_question():
    conversation = Conversation("c", questions=((1,), (2, 3), (4,)),
                                answers=((5, 6), (7,), (8, 9, 10)))
    replay = Replay((conversation,), request_rate=1.0, think_s=2.5, output_cap=8,
                    max_model_len=11)
    (first,) = replay.first_rounds()
    assert first.prompt_token_ids == (1,) and first.output_len == 2
    answered = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[40, 41])])
    (second,) = replay.follow_up(first, answered, clock=10.0)
    assert second.request_id == "c-round-1" and second.arrival_time == 12.5
    assert second.prompt_token_ids == (1, 40, 41, 2, 3) and second.output_len == 1
    # Round 2 holds its 7-token prompt and 3 output tokens: 10 fit in 11; after a
    # 3-token answer its 9-token prompt would not.
    short = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[42])])
    (third,) = replay.follow_up(second, short, clock=20.0)
    assert third.prompt_token_ids == (1, 40, 41, 2, 3, 42, 4)
    long = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[42, 43, 44])])
    assert replay.follow_up(second, long, clock=20.0) == []
    assert replay.follow_up(third, short, clock=30.0) == []  # the last round
