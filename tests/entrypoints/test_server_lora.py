"""The server's LoRA adapters: `--lora-modules`, the request's `model` naming one,
/v1/models, the run-time load and unload endpoints, and the adapters' /metrics series.

The oracle for the answers is the offline engine (`LLM.generate` with the adapter's
LoRARequest; tests/lora checks that path against PEFT), and each adapter's answer
differs from the base model's, so a server that drops the adapter cannot pass. One
server with one adapter slot serves every test here: two adapters take turns in it.
"""

from __future__ import annotations

import copy
import json
import shutil

import openai
import pytest

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged import __main__ as cli
from jpaged.entrypoints.lora import LoRAModule, parse_lora_module
from tests.lora.adapters import ATTENTION, ATTENTION_AND_MLP, save_adapter
from tests.plugins.http_server import (
    SERVED_MODEL,
    SERVER_API_KEY,
    SERVER_ENGINE,
    http_request,
    metric,
    running,
    wait_until_idle,
)

LORA_ENGINE = SERVER_ENGINE | dict(enable_lora=True, max_loras=1, max_lora_rank=8)
PROMPT = "the theater in the"
AUTH = {"Authorization": f"Bearer {SERVER_API_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def adapter_root(tiny_llama_dir, tmp_path_factory):
    """The allowed directory: adapters alpha (attention) and beta (attention + MLP), and
    bad_dora, beta's files with use_dora set."""
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(tiny_llama_dir, root / "alpha", 8, ATTENTION, seed=1)
    save_adapter(tiny_llama_dir, root / "beta", 8, ATTENTION_AND_MLP, seed=2)
    shutil.copytree(root / "beta", root / "bad_dora")
    config_file = root / "bad_dora" / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"use_dora": True}))
    return root


@pytest.fixture(scope="module")
def lora_server(tiny_chat_model, adapter_root):
    """(base_url, AsyncLLMEngine): alpha served from the start, run-time updates on."""
    from jpaged.engine.async_engine import AsyncLLMEngine
    from jpaged.engine.llm_engine import EngineConfig, LLMEngine
    from jpaged.entrypoints.server import build_app

    model, config, tokenizer = tiny_chat_model
    engine = LLMEngine(EngineConfig(model=SERVED_MODEL, **LORA_ENGINE),
                       loaded=(model, config, copy.deepcopy(tokenizer)))
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, SERVED_MODEL, api_key=SERVER_API_KEY,
                    lora_modules=[LoRAModule("alpha", str(adapter_root / "alpha"))],
                    runtime_lora_updating=True, lora_allowed_dir=str(adapter_root))
    with running(app) as base_url:
        yield base_url, async_engine


@pytest.fixture(scope="module")
def lora_offline(tiny_chat_model):
    return LLM(SERVED_MODEL, loaded=tiny_chat_model, **LORA_ENGINE)


@pytest.fixture(scope="module")
def client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server[0]}/v1", api_key=SERVER_API_KEY,
                         max_retries=0, timeout=60)


def _offline_text(llm: LLM, prompt, lora: LoRARequest | None, max_tokens: int = 8) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt, params, lora_request=lora)[0].outputs[0].text


def _post(base_url: str, path: str, body: dict, headers: dict = AUTH):
    return http_request(base_url, "POST", path, json.dumps(body).encode(), headers)


def test_lora_module_specs():
    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "b"}') == \
        LoRAModule("a", "/x", "b")
    for bad in ("a", "=/x", '{"name": "a"}', "{nope"):
        with pytest.raises(ValueError, match=f"{bad!r}: give |{bad!r} is not valid JSON"):
            parse_lora_module(bad)


def test_a_bad_module_spec_stops_the_command_line_before_the_model_loads(capsys, tmp_path):
    """argparse refuses the entry (exit 2, naming the flag); a model that cannot load
    shows that nothing was loaded first (that would end in exit 1)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", str(tmp_path / "no-model"), "--enable-lora",
                  "--lora-modules", "alpha=/x", "beta"])
    assert exit_.value.code == 2
    assert "argument --lora-modules: 'beta': give name=path" in capsys.readouterr().err


def test_modules_are_checked_before_serving(lora_offline, adapter_root):
    """serve() checks each module's adapter first: a bad one names the module, the file
    and the field; run-time updates need an allowed directory."""
    from jpaged.entrypoints.lora import ServedModels
    from jpaged.entrypoints.server import check_lora_modules

    check_lora_modules(lora_offline.engine, [LoRAModule("alpha", str(adapter_root / "alpha"))])
    with pytest.raises(ValueError, match=r"bad=.*bad_dora.*adapter_config.json.*use_dora"):
        check_lora_modules(lora_offline.engine,
                           [LoRAModule("bad", str(adapter_root / "bad_dora"))])
    with pytest.raises(ValueError, match="--lora-allowed-dir"):
        ServedModels(SERVED_MODEL, "tiny", 256, runtime_updates=True)


def test_model_field_selects_the_adapter(client, lora_offline, adapter_root):
    """Completions and streamed chat with model=alpha answer as LLM.generate with alpha's
    LoRARequest; the base model's name answers as the base model, which differs."""
    alpha = LoRARequest("alpha", 1, str(adapter_root / "alpha"))
    expected = _offline_text(lora_offline, PROMPT, alpha)
    assert expected != _offline_text(lora_offline, PROMPT, None)
    for model, lora in (("alpha", alpha), (SERVED_MODEL, None)):
        response = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
        assert response.model == model
        assert response.choices[0].text == _offline_text(lora_offline, PROMPT, lora)
    messages = [{"role": "user", "content": "the other"}]
    chat_prompt = {"prompt_token_ids": lora_offline.engine.apply_chat_template(messages)}
    stream = client.chat.completions.create(model="alpha", messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == _offline_text(lora_offline, chat_prompt, alpha)
    # LLM.chat takes the adapter as generate does (vLLM's argument).
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    chats = [lora_offline.chat(messages, params, lora_request=lora)[0].outputs[0].text
             for lora in (alpha, None)]
    assert chats[0] == text != chats[1]


def test_models_list_the_adapters_under_the_base_model(client, adapter_root):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {SERVED_MODEL, "alpha"}
    assert cards["alpha"].parent == SERVED_MODEL
    assert cards["alpha"].root == str(adapter_root / "alpha")
    assert client.models.retrieve("alpha").id == "alpha"
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_at_run_time(lora_server, client, lora_offline, adapter_root):
    """beta loads from inside the allowed directory, answers as offline, shows in the
    list; unloaded, it is gone, its idle slot freed, and requests naming it get 404."""
    base_url, engine = lora_server
    reply = _post(base_url, "/v1/load_lora_adapter",
                  {"lora_name": "beta", "lora_path": str(adapter_root / "beta")})
    assert reply.status == 200, reply.text
    assert "beta" in {card.id for card in client.models.list().data}
    response = client.completions.create(model="beta", prompt=PROMPT, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    slots = engine.engine.state().lora  # read between steps: the engine is idle
    assert slots.slots_loaded >= 1 and "beta" not in slots.running
    beta = LoRARequest("beta", 7, str(adapter_root / "beta"))
    assert response.choices[0].text == _offline_text(lora_offline, PROMPT, beta)
    again = _post(base_url, "/v1/load_lora_adapter",
                  {"lora_name": "beta", "lora_path": str(adapter_root / "beta")})
    assert again.status == 400 and "already been loaded" in again.text
    reply = _post(base_url, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert reply.status == 200, reply.text
    assert engine.engine.state().lora.slots_loaded == slots.slots_loaded - 1  # beta's, idle, freed
    assert "beta" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    assert _post(base_url, "/v1/unload_lora_adapter", {"lora_name": "beta"}).status == 404


@pytest.mark.full  # a 24-token stream unloaded after its first chunk
def test_unloading_lets_running_requests_finish(lora_server, client, lora_offline,
                                                adapter_root):
    base_url, engine = lora_server
    path = str(adapter_root / "beta")
    assert _post(base_url, "/v1/load_lora_adapter",
                 {"lora_name": "gamma", "lora_path": path}).status == 200
    stream = client.completions.create(model="gamma", prompt=PROMPT, max_tokens=24,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert _post(base_url, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status == 200
    text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == _offline_text(lora_offline, PROMPT, LoRARequest("gamma", 9, path), 24)
    wait_until_idle(engine)


def test_load_refusals(lora_server, adapter_root, tmp_path):
    """A bad adapter: 400 naming its file and field, not listed; a path outside the
    allowed directory: 400 naming the directory; no API key: 401."""
    base_url, _ = lora_server
    bad = _post(base_url, "/v1/load_lora_adapter",
                {"lora_name": "bad", "lora_path": str(adapter_root / "bad_dora")})
    assert bad.status == 400
    assert "adapter_config.json" in bad.json()["error"]["message"]
    assert "use_dora" in bad.json()["error"]["message"]
    missing = _post(base_url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "nope"})
    assert missing.status == 400 and "adapter_config.json" in missing.text
    outside = _post(base_url, "/v1/load_lora_adapter",
                    {"lora_name": "out", "lora_path": str(tmp_path)})
    assert outside.status == 400 and str(adapter_root) in outside.text
    escape = _post(base_url, "/v1/load_lora_adapter",
                   {"lora_name": "out", "lora_path": "../.."})
    assert escape.status == 400 and "outside the allowed directory" in escape.text
    no_key = _post(base_url, "/v1/load_lora_adapter",
                   {"lora_name": "x", "lora_path": str(adapter_root / "alpha")},
                   headers={"Content-Type": "application/json"})
    assert no_key.status == 401
    models = http_request(base_url, "GET", "/v1/models", headers=AUTH).json()
    assert {card["id"] for card in models["data"]}.isdisjoint({"bad", "out", "x"})


def test_runtime_updates_are_off_by_default(server):
    """The shared server (no flag): both endpoints answer 404."""
    base_url, _ = server
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        reply = _post(base_url, path, body)
        assert reply.status == 404 and "--enable-runtime-lora-updating" in reply.text


def test_metrics_show_the_slots_beside_the_kv_pool(lora_server, client):
    """The slots' bytes follow the documented layout (jpaged.lora.peft): per layer and
    slot, each fused projection holds A [in, P * R] and B [P * R, out], float32."""
    base_url, engine = lora_server
    client.completions.create(model="alpha", prompt=PROMPT, max_tokens=2)
    wait_until_idle(engine)
    hidden, q, kv, inter, layers, rank = 64, 64, 32, 128, 2, 8
    fused = [(hidden, 3, q + 2 * kv), (q, 1, hidden), (hidden, 2, 2 * inter), (inter, 1, hidden)]
    slot_bytes = layers * 4 * sum(pieces * rank * (n_in + n_out)
                                  for n_in, pieces, n_out in fused)
    assert metric(base_url, "jpaged:lora_slot_bytes") == slot_bytes
    assert metric(base_url, "jpaged:lora_slots_total") == 1
    assert metric(base_url, "jpaged:lora_slots_loaded") == 1
    assert metric(base_url, "jpaged:lora_slots_in_use") == 0
    assert metric(base_url, "jpaged:lora_loads_total") >= 1
    assert metric(base_url, "jpaged:lora_reads_total") >= 1
    assert metric(base_url, "jpaged:lora_read_seconds_total") > 0
    text = http_request(base_url, "GET", "/metrics").text
    assert 'jpaged:lora_requests_info{max_lora="1",running_lora_adapters="",' \
           'waiting_lora_adapters=""}' in text
