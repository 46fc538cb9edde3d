"""System prompts the server reserves at start-up: the tokens of the system turn as the
chat template writes it (here ChatML, spelled out), held for every chat request that
opens with it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from jpaged import __main__ as cli
from jpaged.engine.protocol import EngineState
from jpaged.entrypoints import server
from jpaged.entrypoints.metrics import EngineCollector
from jpaged.sampling_params import SamplingParams

SYSTEM = "You answer in the theme of the air, and in three words at most."


def reserved_gauge(state: EngineState) -> float:
    """/metrics' jpaged:kv_cache_blocks_reserved for an engine in `state`."""
    engine = SimpleNamespace(state=state)
    [family] = [family for family in EngineCollector(engine).collect()
                if family.name == "jpaged:kv_cache_blocks_reserved"]
    return family.samples[0].value


def test_chat_requests_opening_with_a_reserved_system_prompt_hit_it(offline, caplog):
    engine = offline.engine
    with caplog.at_level(logging.INFO, logger="jpaged"):
        [prefix] = server.reserve_system_prompts(engine, [SYSTEM])
    turn = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    num_tokens = len(offline.get_tokenizer().encode(turn, add_special_tokens=False))
    assert prefix.num_tokens == num_tokens
    assert prefix.num_cached_tokens == num_tokens // 8 * 8 > 0
    assert (f"reserved system prompt {prefix.prefix_id}: {num_tokens} tokens, "
            f"{prefix.num_cached_tokens} of them in full blocks, held in "
            f"{prefix.num_blocks} KV blocks") in caplog.text
    try:
        assert reserved_gauge(engine.state()) == prefix.num_blocks
        assert reserved_gauge(EngineState.total([engine.state()] * 2)) == 2 * prefix.num_blocks
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "the theme in the air, then"}]
        output = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=2))[0]
        assert output.num_cached_tokens == prefix.num_cached_tokens
    finally:
        engine.release_prefix(prefix)


def test_without_a_chat_template_the_text_itself_is_reserved(offline, monkeypatch):
    monkeypatch.setattr(offline.engine.tokenizer, "chat_template", None)
    assert server.system_prompt_tokens(offline.engine, SYSTEM) == (
        offline.get_tokenizer().encode(SYSTEM))


def test_serve_reserves_each_system_prompt_before_serving(offline, monkeypatch):
    args = cli._parser().parse_args(["serve", "--reserved-system-prompt", SYSTEM,
                                     "--reserved-system-prompt", "Be brief."])
    assert args.reserved_system_prompt == [SYSTEM, "Be brief."]
    served = []
    manager = offline.engine.block_manager

    def serve(engine, **options):
        served.append([r.prefix.num_tokens for r in manager.reserved_prefixes])

    monkeypatch.setattr(server, "serve", serve)
    cli._serve(offline, args)
    reserved = list(manager.reserved_prefixes)
    for reservation in reserved:
        offline.engine.release_prefix(reservation.prefix)
    assert served == [[r.prefix.num_tokens for r in reserved]] and len(reserved) == 2
