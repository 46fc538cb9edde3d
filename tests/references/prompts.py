"""The prompts of the stored references, and of the live tests against transformers that
share them. Plain data: the regeneration command imports it, and it imports nothing of
jpaged.
"""

from __future__ import annotations

# SmolLM2-135M-Instruct: chat conversations (through its ChatML template) and plain text.
SMOLLM2_GREEDY = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    "Once upon a time, in a small village by the mountains,",
]
# (prompt, beam widths): each prompt searched with each width.
SMOLLM2_BEAMS = [
    ([{"role": "user", "content": "What is the capital of France?"}], (2, 4)),
    ([{"role": "user", "content": "Name three programming languages."}], (2, 4)),
]
# Texts whose ids are stored beside the prompts' own.
SMOLLM2_TOKENIZER = [
    "  two  spaces,\ttabs and\n\nnewlines", "émojis 🤖 et 中文", " leading space",
    "<|im_start|>user\nhi<|im_end|>", "the  theme\n\n\nin 2024: 1234567, theirs/ours",
]

# Gemma 3 270M (base, no chat template): plain text, one prompt longer than its sliding
# window of 512 tokens.
CITIES = [("Paris", "France"), ("Madrid", "Spain"), ("Rome", "Italy"), ("Berlin", "Germany"),
          ("Lisbon", "Portugal"), ("Vienna", "Austria"), ("Warsaw", "Poland"),
          ("Athens", "Greece")]
# About 770 tokens: a list whose beginning lies outside the window when the answer comes.
LONG_TEXT = "".join(
    f"Record {i}: {city} is the capital of {country}; its population was counted in "
    f"{1900 + 7 * i}.\n" for i, (city, country) in enumerate(CITIES * 4)
) + "Question: which city is listed in Record 0? Answer:"
GEMMA3_GREEDY = ["The capital of France is", "def fibonacci(n):\n   ",
                 "Photosynthesis is the process by which", LONG_TEXT]
# Texts whose ids are stored beside the prompts' own.
GEMMA3_TOKENIZER = ["  two  spaces,\ttabs and\n\nnewlines", "émojis 🤖 et 中文",
                    "<start_of_turn>user\nhi<end_of_turn>", " leading space", "\u200b<unused3>"]
GEMMA3_BEAMS = [("The capital of France is", (2, 4)),
                ("Photosynthesis is the process by which", (2,))]
# The follow-up that shares the long prompt's first tokens (a prefix-cache hit whose
# sliding layers hold only the window of the hit's end): LONG_TEXT's first
# GEMMA3_SHARED_TOKENS token ids, then this text's (without special tokens).
GEMMA3_SHARED_TOKENS = 600
GEMMA3_FOLLOW_UP = " Record 9 lists"
