"""The engine's side of the reference tests: one run of a reference's greedy cases and
beam searches, compared with it under the near-tie rule (tests/references/compare.py)."""

from __future__ import annotations

from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from tests.references.compare import compare_beam, compare_greedy


def prompt_ids(llm: LLM, case: dict) -> list[int]:
    """The case's prompt through jpaged's tokenizer, as the reference tokenized it."""
    if case["tokenization"] == "chat_template":
        return llm.engine.apply_chat_template(case["prompt"])
    return llm.get_tokenizer().encode(case["prompt"])


def check_tokenization(llm: LLM, reference: dict) -> None:
    """The engine's EOS ids, the tokenizer's ids and decoding of the reference's texts, and
    every prompt's ids, as the reference has them."""
    tokenizer = llm.get_tokenizer()
    assert list(llm.engine.eos_token_ids) == reference["eos_token_ids"]
    for case in reference["tokenizer"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.decode(case["ids"]) == case["decoded"], case["text"]
    for case in reference["greedy"] + reference["beams"]:
        assert prompt_ids(llm, case) == case["prompt_ids"], case["prompt"]


def run_reference(llm: LLM, reference: dict) -> dict[str, object]:
    """Every greedy case and beam search of the reference in one engine run; the finished
    outputs by request id ("greedy-i", "beam-i")."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=reference["settings"]["new_tokens"],
                            ignore_eos=True, logprobs=reference["settings"]["top_logprobs"])
    for i, case in enumerate(reference["greedy"]):
        engine.add_request(f"greedy-{i}", case["prompt_ids"], greedy)
    for i, case in enumerate(reference["beams"]):
        engine.add_request(f"beam-{i}", case["prompt_ids"], BeamSearchParams(
            beam_width=case["beam_width"], max_tokens=case["max_tokens"], scoring="transformers",
            length_penalty=case["length_penalty"], early_stopping=case["early_stopping"]))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


def compare_run(reference: dict, done: dict, eos: list[int]) -> dict[str, int]:
    """Every answer of the run against the reference; the near ties accepted, by kind."""
    ties = {"greedy": 0, "top-k boundary": 0, "beam": 0}
    for i, case in enumerate(reference["greedy"]):
        completion = done[f"greedy-{i}"].outputs[0]
        logprobs = [{token: entry.logprob for token, entry in step.items()}
                    for step in completion.logprobs]
        diverged, boundary = compare_greedy(case, completion.token_ids, logprobs)
        ties["greedy"] += diverged
        ties["top-k boundary"] += boundary
    for i, case in enumerate(reference["beams"]):
        ties["beam"] += compare_beam(case, done[f"beam-{i}"].outputs[0].token_ids, eos)
    return ties
