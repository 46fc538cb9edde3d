"""vLLM's option names and what a first afternoon meets: prefix caching and swapping by
their flags, a model without a chat template (raw text for generate, a refusal naming
the remedies for chat, a template of one's own), unknown options answered with the
closest, --help with defaults, and jobs of several processes started the wrong way."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys

import jinja2
import pytest

from jpaged import LLM, SamplingParams, launch
from jpaged import __main__ as cli
from jpaged.model.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=3)
# A prompt of several whole 8-token blocks (about 40 tokens of the tiny tokenizer).
LONG_PROMPT = " ".join(["the theme in the air"] * 3)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _llm(loaded, **settings) -> LLM:
    return LLM("tiny", loaded=loaded, block_size=8, max_model_len=128,
               persistent_compilation_cache=False, **settings)


@pytest.mark.parametrize("enabled", [True, False])
def test_enable_prefix_caching_decides_whether_a_repeated_prompt_is_served(loaded, enabled):
    llm = _llm(loaded, enable_prefix_caching=enabled)
    first, = llm.generate(LONG_PROMPT, GREEDY)
    second, = llm.generate(LONG_PROMPT, GREEDY)
    full_blocks = (len(first.prompt_token_ids) - 1) // 8 * 8  # the last token is computed
    assert second.num_cached_tokens == (full_blocks if enabled else 0)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.full  # compiles a second engine's steps (about 25 s)
def test_swap_preemption_needs_no_other_setting(loaded):
    """preemption_mode="swap" alone gets vLLM's swap space; a pool too small for every
    sequence preempts by swapping, and greedy tokens stay those of an unpressed pool."""
    prompts = [f"{LONG_PROMPT} {i}" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = _llm(loaded).generate(prompts, params)
    swapping = _llm(loaded, preemption_mode="swap", num_blocks=24)
    pressed = swapping.generate(prompts, params)
    assert swapping.engine.stats.summary()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in pressed] == [o.outputs[0].token_ids for o in roomy]


def test_chat_without_a_template_names_the_remedies(loaded):
    llm = _llm(loaded)
    assert llm.get_tokenizer().chat_template is None  # the tiny model has none
    with pytest.raises(ValueError, match=r"no chat template: give one \(LLM.chat\(chat_template"
                                         r"=...\), --chat-template FILE.*generate --raw"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)


def test_chat_template_argument_renders_the_conversation(loaded):
    llm = _llm(loaded)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (output,) = llm.chat(messages, GREEDY, chat_template=TEMPLATE)
    text = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert output.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_generate_sends_raw_text_when_the_model_has_no_template(
        tiny_llama_dir, capsys, jpaged_logger_restored):
    prompts = ["the theme in the", "in the air"]
    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "5", *prompts]
    assert cli.main(args) == 0
    templated_out, err = capsys.readouterr()
    assert err.count("has no chat template: the prompts go as plain text") == 1
    assert cli.main([*args, "--raw"]) == 0
    assert capsys.readouterr().out == templated_out


def test_cli_chat_refuses_without_a_template_and_chats_with_one(
        tiny_llama_dir, tmp_path, capsys, monkeypatch, jpaged_logger_restored):
    common = ["chat", "--model", str(tiny_llama_dir), "--max-tokens", "3"]
    assert cli.main(common) == 1
    err = capsys.readouterr().err
    assert "--chat-template FILE" in err and "python -m jpaged generate --raw" in err
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    lines = iter(["the theme", ""])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    assert cli.main([*common, "--chat-template", str(template)]) == 0
    assert capsys.readouterr().out.startswith("model> ")
    assert cli.main([*common, "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    assert "missing.jinja: cannot read it" in capsys.readouterr().err


def test_cli_chat_refuses_before_the_weights_load(tiny_llama_dir, tmp_path, capsys):
    """The refusal comes from the tokenizer's files: a directory without weights, which
    could not load, gets it rather than a load error."""
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_llama_dir, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    assert cli.main(["chat", "--model", str(weightless)]) == 1
    assert "has no chat template" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "wrong", "right"), [
    (["generate", "hi"], "--gpu-memory-utilisation", "--gpu-memory-utilization"),
    (["serve"], "--swap-spaces", "--swap-space"),
    (["chat"], "--no-prefix-caching", "--no-enable-prefix-caching"),
])
def test_unknown_flag_names_the_closest(capsys, command, wrong, right):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, wrong, "1"])
    assert exit_.value.code == 2
    message = capsys.readouterr().err.splitlines()[-1]
    assert f"no option '{wrong}'; did you mean " in message and f"'{right}'" in message


def test_flags_give_vllms_units():
    args = cli._parser().parse_args(["serve", "--kv-cache-memory-bytes", "1.5GiB",
                                     "--num-gpu-blocks-override", "100",
                                     "--no-enable-prefix-caching", "--swap-space", "2"])
    assert args.kv_cache_memory_bytes == 3 * 2**29 and args.num_blocks == 100
    assert args.enable_prefix_caching is False and args.swap_space == 2.0
    assert cli._byte_size("512MB") == 512 * 10**6 and cli._byte_size("4096") == 4096
    with pytest.raises(ValueError, match="takes GiB, and 2e\\+09 GiB looks like bytes"):
        cli._kv_cache_memory_bytes(cli._parser().parse_args(
            ["serve", "--kv-cache-memory", "2e9"]))


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_shows_defaults(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-dtype" in text and "(default: auto)" in text
    assert "--preemption-mode" in text and "(default: recompute)" in text
    # A help text that says no default gets its default appended to that flag's entry.
    assert re.search(r"--dtype \{float32,bfloat16,float16\} the weights' and the "
                     r"computation's dtype \(default: float32\)", text)


def test_distributed_outside_a_launcher_names_the_launcher():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JPAGED_", "JAX_COORD"))}
    result = subprocess.run([sys.executable, "-c", "from jpaged.launch import initialize; "
                             "initialize()"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    for words in ("python -m jpaged.launch", launch.ADDRESS, launch.NUM_PROCESSES,
                  launch.PROCESS_ID):
        assert words in result.stderr


def test_launcher_warns_when_the_command_lacks_distributed(capsys):
    launch.check_command(("-m", "jpaged", "generate", "hi"))
    assert "has no --distributed" in capsys.readouterr().err
    launch.check_command(("-m", "jpaged", "generate", "--distributed", "hi"))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("is_first", "env", "level"), [
    (True, None, logging.INFO), (False, None, logging.WARNING), (False, "info", logging.INFO),
])
def test_only_process_0_logs_at_info_unless_asked(monkeypatch, jpaged_logger_restored,
                                                  is_first, env, level):
    if env is None:
        monkeypatch.delenv(launch.LOGGING_LEVEL, raising=False)
    else:
        monkeypatch.setenv(launch.LOGGING_LEVEL, env)
    launch._set_log_level(is_first)
    assert logging.getLogger("jpaged").level == level


@pytest.mark.full  # two SmolLM2 runs in subprocesses (about a minute)
def test_tensor_parallel_3_on_simulated_cpu_devices_gives_one_devices_tokens():
    """SmolLM2's 9 query and 3 KV heads split over 3 devices that --num-cpu-devices
    simulates; greedy tokens equal those of one device."""
    def answer(*flags: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "jpaged", "generate", "The capital of France is",
             "--max-tokens", "8", *flags], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert answer("--num-cpu-devices", "3", "-tp", "3") == answer()


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"]])
def test_attention_backend_flag_offers_every_implementation(command):
    import kernels_pallas

    for backend in kernels_pallas.IMPLEMENTATIONS:
        args = cli._parser().parse_args([*command, "--attention-backend", backend])
        assert args.attention_backend == backend
