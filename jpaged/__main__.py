"""Command line: `python -m jpaged generate "prompt"`, `python -m jpaged chat` and
`python -m jpaged serve` (an OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jpaged.memory.reservation import ALLOCATIONS
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from jpaged.entrypoints.llm import LLM

# Failures the user can fix: bad arguments, model files missing or malformed, no network
# (DownloadError), a missing optional package, a kernel or step the device cannot run
# (RuntimeError, as XLA raises them). Anything else keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, ImportError, RuntimeError)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option's text with its default, unless the text says it already
    or there is none to show (None, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default == [] or default == argparse.SUPPRESS or "default" in text):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """argparse, whose error for an unknown option names the closest known ones."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        command = self.commands[parsed.command]
        flags = [arg.split("=")[0] for arg in unknown if arg.startswith("-")]
        if flags:
            from jpaged.suggestions import unknown_message

            command.error(unknown_message(flags[0], command._option_string_actions,
                                          command.prog))
        if unknown:
            command.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m jpaged", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(commands.add_parser, formatter_class=_DefaultsFormatter)
    generate = add("generate", help="answer one or more prompts and exit")
    generate.add_argument("prompts", nargs="+", help="prompts, run as one batch")
    generate.add_argument("--raw", action="store_true",
                          help="send the prompts as plain text, not through the chat template "
                          "(a model without a chat template gets them so anyway)")
    generate.add_argument("--stats", action="store_true", help="print the run's statistics as JSON")
    chat = add("chat", help="talk to the model; an empty line or Ctrl-D quits")
    chat.add_argument("--system", default=None, help="a system message")
    serve = add("serve", help="serve the OpenAI API (/v1/completions, /v1/chat/completions, "
                "/v1/models, /tokenize, /detokenize, /health, /metrics) over HTTP")
    parser.commands = {"generate": generate, "chat": chat, "serve": serve}
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the --model argument)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 requests")
    serve.add_argument("--max-waiting", type=int, default=1024,
                       help="requests waiting for their first token before new ones get 503")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                       help="on SIGINT/SIGTERM, seconds running requests get to finish before "
                       "they are aborted (open streams then end with an error event)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report in each response's usage the prompt tokens the prefix "
                       "cache served (usage.prompt_tokens_details.cached_tokens)")
    serve.add_argument("--reserved-system-prompt", action="append", default=[],
                       metavar="TEXT",
                       help="keep the KV blocks of this system prompt, as the chat template "
                       "renders it (the text itself without a template), for every chat "
                       "request that opens with it; repeatable")
    serve.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[],
                       metavar="NAME=PATH",
                       help="LoRA adapters to serve (with --enable-lora): requests name one "
                       "as their model; each NAME=PATH, or vLLM's JSON {\"name\": ..., "
                       "\"path\": ..., \"base_model_name\": ...}")
    serve.add_argument("--enable-runtime-lora-updating", action="store_true",
                       help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                       "(off by default, as in vLLM; needs --lora-allowed-dir)")
    serve.add_argument("--lora-allowed-dir", default=None, metavar="DIR",
                       help="the directory adapters loaded at run time must lie in")
    serve.add_argument("--warmup", action="store_true",
                       help="compile every step shape before accepting requests (slower "
                       "start-up; no compile pauses while serving)")
    for sub in (generate, chat):
        sub.add_argument("--max-tokens", type=int, default=128,
                         help="new tokens per answer at most")
        sub.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
        sub.add_argument("--top-p", type=float, default=1.0,
                         help="sample from the smallest set of tokens this likely")
        sub.add_argument("--top-k", type=int, default=0,
                         help="sample from the k likeliest tokens (0: all)")
        sub.add_argument("--seed", type=int, default=None, help="the sampler's seed")
        sub.add_argument("--ignore-eos", action="store_true",
                         help="generate max-tokens tokens whatever the model says")
        sub.add_argument("--structured-outputs", type=_json_object, default=None,
                         metavar="JSON",
                         help="a grammar every answer keeps to, as vLLM's "
                         "StructuredOutputsParams in JSON: '{\"json\": {schema}}', "
                         "'{\"regex\": \"...\"}', '{\"choice\": [...]}', "
                         "'{\"grammar\": \"lark\"}' or '{\"json_object\": true}', with "
                         "disable_any_whitespace, disable_additional_properties and "
                         "whitespace_pattern")
    for sub in (generate, serve):
        sub.add_argument("--distributed", action="store_true",
                         help="join a job of several processes (python -m jpaged.launch, "
                         "or one process per host; see docs/multihost.md): every process "
                         "runs the command, process 0 prints or serves")
    chat.set_defaults(distributed=False)  # it reads this terminal: one process
    for sub in (generate, chat, serve):
        sub.add_argument("--model", default="smollm2",
                         help="'smollm2' (the default), 'gemma3', a Hugging Face model "
                         "directory or a .gguf file")
        sub.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                         help="the weights' and the computation's dtype")
        sub.add_argument("--chat-template", default=None, metavar="FILE",
                         help="a jinja2 chat template used instead of the model's (gemma3's "
                         "GGUF has none)")
        sub.add_argument("--num-cpu-devices", type=int, default=None, metavar="N",
                         help="simulate N devices on a CPU, for tensor and data parallelism "
                         "without accelerators (JAX's JAX_NUM_CPU_DEVICES; no effect on an "
                         "accelerator)")
        # EngineConfig's KV_CACHE_DTYPES and their vLLM aliases, spelled out (no jax for --help).
        sub.add_argument("--kv-cache-dtype", default="auto",
                         choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3",
                                  "fp8_e5m2", "fp8", "int8_per_token_head",
                                  "fp8_per_token_head"],
                         help="what the KV cache stores: auto is the model's dtype; int8 and "
                         "fp8 keep 1-byte values with a float32 scale per token and KV head")
        sub.add_argument("--block-size", type=int, default=None,
                         help="tokens per KV block (default 16; 32 for 1-byte pages on a TPU)")
        sub.add_argument("--kv-cache-memory-bytes", type=_byte_size, default=None,
                         metavar="SIZE",
                         help="KV cache budget in bytes, or with a unit: 512MiB, 2GiB, 1GB "
                         "(default: 0.9 of free accelerator memory; on a CPU the weights' "
                         "size, at most 1/4 of free RAM; never more than the sequences that "
                         "can run at once fill: generate runs its prompts, chat one "
                         "conversation)")
        sub.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                         help="deprecated: the KV cache budget in GiB; use "
                         "--kv-cache-memory-bytes")
        sub.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                         help="the fraction of the device's memory the engine may use, "
                         "weights included (vLLM's meaning); the KV pool gets the rest")
        sub.add_argument("--kv-cache-fraction", type=float, default=None, metavar="F",
                         help="the KV pool's fraction of the memory free once the weights "
                         "are loaded (jpaged's own)")
        sub.add_argument("--num-blocks", "--num-gpu-blocks-override", type=int, default=None,
                         help="KV pool size in blocks, the null block included")
        sub.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                         help="host memory for swapped-out KV blocks in GiB (default: 4 with "
                         "--preemption-mode swap and no other host pool, else none)")
        sub.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                         help="host memory in GiB for the prefix cache's second tier "
                         "(prefixes that left the device are loaded back, not recomputed); "
                         "one host pool holds it and --swap-space (default: none)")
        sub.add_argument("--preemption-mode", choices=["recompute", "swap"],
                         default="recompute",
                         help="what a preempted sequence's KV blocks become: freed and "
                         "computed again, or swapped out to host memory")
        sub.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                         default=None,
                         help="share the KV blocks of common prompt prefixes across requests "
                         "(default: on, off under an Orca allocation)")
        sub.add_argument("--enforce-eager", action="store_true",
                         help="accepted for vLLM's command lines; changes nothing (jpaged has "
                         "no CUDA graphs: every step is compiled by jax.jit)")
        sub.add_argument("--max-model-len", type=int, default=None,
                         help="tokens a sequence holds at most (default: the model's, "
                         "at most 2048)")
        sub.add_argument("--allocation", choices=ALLOCATIONS, default="paged",
                         help="KV allocation: paged, or an Orca baseline reserving each "
                         "request's max_model_len, prompt + pow2(output) or true length "
                         "(orca-pow2 and orca-oracle need --ignore-eos)")
        # None unless given: the engine decides (every block is kept under an Orca allocation).
        sub.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=None,
                         help="keep every KV block of a model with sliding-window "
                         "layers, instead of freeing those that leave a sequence's window")
        sub.add_argument("--max-num-seqs", type=int, default=None,
                         help="sequences one step runs at most (default: the engine's)")
        sub.add_argument("--max-num-batched-tokens", type=int, default=None,
                         help="tokens one step runs at most, prefill chunks and decodes "
                         "(default: the engine's)")
        sub.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                         help="run the model over N devices (Megatron-style tensor parallelism)")
        sub.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="M",
                         help="run M replicas of the engine, each on its own N devices; "
                         "requests go to the least loaded")
        # kernels_pallas.IMPLEMENTATIONS, spelled out: importing it would load jax for --help.
        sub.add_argument("--attention-backend",
                         choices=["tpu", "mosaic_gpu", "triton", "xla", "reference",
                                  "pallas"],
                         default=None, help="default: the device's own (tpu on a TPU, "
                         "mosaic_gpu on a Hopper GPU, triton on other GPUs, xla on a CPU); "
                         "'pallas' is a deprecated name for it")
        sub.add_argument("--speculative-config", type=_json_object, default=None,
                         metavar="JSON",
                         help="speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", "
                         "\"num_speculative_tokens\": 4}' (also prompt_lookup_min and "
                         "prompt_lookup_max)")
        sub.add_argument("--num-decode-steps", type=int, default=None, metavar="S",
                         help="decode steps a batch whose sequences all decode runs on the "
                         "device before the host schedules again (default: 1, the host "
                         "schedules every step)")
        sub.add_argument("--async-scheduling", action="store_true",
                         help="schedule each step while the device runs the one before it")
        sub.add_argument("--enable-lora", action="store_true",
                         help="serve LoRA adapters (requests name theirs)")
        sub.add_argument("--max-loras", type=int, default=1,
                         help="LoRA adapters on the device at once (their slots' bytes come "
                         "off the KV pool's budget)")
        sub.add_argument("--max-lora-rank", type=int, default=16,
                         help="the largest rank of an adapter")
        sub.add_argument("--max-cpu-loras", type=int, default=None,
                         help="adapters kept read on the host (default: --max-loras)")
        sub.add_argument("--debug", action="store_true",
                         help="show the traceback of an error instead of one line")
    return parser


def _json_object(text: str) -> dict:
    """A JSON object from the command line (argparse names the flag on an error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _lora_module(text: str):
    """A --lora-modules entry, refused before the model loads (argparse names the flag)."""
    from jpaged.entrypoints.lora import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# Byte units --kv-cache-memory-bytes takes (vLLM's kinds: decimal and binary).
BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# GiB given to the deprecated --kv-cache-memory beyond this are bytes by mistake.
MOST_GIB = 2**16


def _byte_size(text: str) -> int:
    """Bytes from "2147483648", "2GiB", "512MiB", "1.5GB" (argparse names the flag on an
    error)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no size: give bytes, or a number with one of "
            f"{', '.join(u for u in BYTE_UNITS if u)} (2GiB, 512MiB)")
    return int(float(match.group(1)) * BYTE_UNITS[unit])


def _kv_cache_memory_bytes(args: argparse.Namespace) -> int | None:
    """--kv-cache-memory-bytes, or the deprecated --kv-cache-memory's GiB in bytes."""
    if args.kv_cache_memory is None:
        return args.kv_cache_memory_bytes
    if args.kv_cache_memory_bytes is not None:
        raise ValueError("give --kv-cache-memory-bytes or the deprecated --kv-cache-memory, "
                         "not both")
    if args.kv_cache_memory > MOST_GIB:
        raise ValueError(f"--kv-cache-memory takes GiB, and {args.kv_cache_memory:g} GiB looks "
                         "like bytes: give --kv-cache-memory-bytes "
                         f"{int(args.kv_cache_memory)} instead")
    logging.getLogger("jpaged").warning(
        "--kv-cache-memory (GiB) is deprecated: use --kv-cache-memory-bytes (bytes, or e.g. "
        "%gGiB)", args.kv_cache_memory)
    return int(args.kv_cache_memory * 2**30)


def _chat_template(args: argparse.Namespace) -> str | None:
    """The text of --chat-template's file."""
    if args.chat_template is None:
        return None
    try:
        return Path(args.chat_template).read_text()
    except OSError as error:
        raise ValueError(f"--chat-template {args.chat_template}: cannot read it "
                         f"({error.strerror})") from None


def _simulate_cpu_devices(count: int | None) -> None:
    """--num-cpu-devices: JAX's CPU backend with `count` devices, set before it starts."""
    if count is None:
        return
    if count < 1:
        raise ValueError(f"--num-cpu-devices must be at least 1, got {count}")
    import jax

    jax.config.update("jax_num_cpu_devices", count)


def _llm(args: argparse.Namespace) -> LLM:
    from jpaged.entrypoints.llm import LLM  # after parsing, so --help and bad flags need no jax

    limits = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens")
              if getattr(args, name) is not None}
    return LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
               block_size=args.block_size, num_blocks=args.num_blocks,
               kv_cache_memory_bytes=_kv_cache_memory_bytes(args),
               gpu_memory_utilization=args.gpu_memory_utilization,
               kv_cache_fraction=args.kv_cache_fraction, swap_space=args.swap_space,
               kv_offloading_size=args.kv_offloading_size,
               preemption_mode=args.preemption_mode,
               enable_prefix_caching=args.enable_prefix_caching,
               enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
               attention_backend=args.attention_backend, allocation=args.allocation,
               disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
               tensor_parallel_size=args.tensor_parallel_size,
               data_parallel_size=args.data_parallel_size,
               speculative_config=args.speculative_config,
               num_decode_steps=args.num_decode_steps, async_scheduling=args.async_scheduling,
               enable_lora=args.enable_lora, max_loras=args.max_loras,
               max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
               **(_batch_limit(args) | limits))


def _batch_limit(args: argparse.Namespace) -> dict[str, int]:
    """generate runs its prompts as one batch and chat one conversation: no more sequences
    than that ever run, so the KV pool (sized for max_num_seqs full-length sequences when
    no budget is given) holds just those, instead of taking a share of free memory."""
    if args.command == "generate":
        return {"max_num_seqs": len(args.prompts)}
    if args.command == "chat":
        return {"max_num_seqs": 1}
    return {}


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                          structured_outputs=_structured_outputs(args.structured_outputs))


def _structured_outputs(fields: dict | None) -> StructuredOutputsParams | None:
    """--structured-outputs' JSON as StructuredOutputsParams (ValueError naming a key it
    does not have)."""
    if fields is None:
        return None
    known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--structured-outputs has no field {unknown[0]!r}; its fields are "
                         f"{', '.join(sorted(known))}")
    return StructuredOutputsParams(**fields)


def _generate(llm: LLM, args: argparse.Namespace) -> None:
    template = _chat_template(args)
    raw = args.raw or (template is None and llm.get_tokenizer().chat_template is None)
    if raw and not args.raw:
        logging.getLogger("jpaged").info(
            "%s has no chat template: the prompts go as plain text, as with --raw (give "
            "--chat-template FILE to send them as chat messages)", args.model)
    if raw:
        outputs = llm.generate(args.prompts, _sampling_params(args))
    else:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, _sampling_params(args), chat_template=template)
    if not _is_first_process(args):
        return
    for prompt, output in zip(args.prompts, outputs, strict=True):
        if len(outputs) > 1:
            print(f"### {prompt}")
        print(output.outputs[0].text.strip())
    if args.stats:
        print(json.dumps(llm.engine.stats.summary(), indent=2))


def _is_first_process(args: argparse.Namespace) -> bool:
    if not args.distributed:
        return True
    import jax

    return jax.process_index() == 0


def _needs_a_chat_template(args: argparse.Namespace) -> None:
    """chat renders every turn: without --chat-template, a model without a template is
    refused from its tokenizer alone, before its weights load."""
    if _chat_template(args) is not None:
        return
    from jpaged.model.loader import read_tokenizer
    from jpaged.model.tokenizer import NO_CHAT_TEMPLATE

    if read_tokenizer(args.model).chat_template is None:
        raise ValueError(f"{args.model}: {NO_CHAT_TEMPLATE}")


def _chat(llm: LLM, args: argparse.Namespace) -> None:
    template = _chat_template(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    params = _sampling_params(args)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, chat_template=template)[0].outputs[0].text.strip()
        history.append({"role": "assistant", "content": reply})
        print(f"model> {reply}", flush=True)


def _serve(llm: LLM, args: argparse.Namespace) -> None:
    from jpaged.engine.mirror import RequestMirror, follow
    from jpaged.entrypoints.server import (  # the HTTP stack loads only for this command
        reserve_system_prompts,
        serve,
    )

    engine, template = llm.engine, _chat_template(args)
    # Every process reserves: their engines step in lockstep.
    reserve_system_prompts(engine, args.reserved_system_prompt, template)
    if not _is_first_process(args):
        if args.warmup:
            engine.warmup()
        follow(engine)
        return
    if args.distributed:
        engine = RequestMirror(engine)
        # The server ends by raising the signal that stopped it again; as an exception it
        # lets serve() stop the other processes before this one exits.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    serve(engine, served_model_name=args.served_model_name or args.model, host=args.host,
          port=args.port, api_key=args.api_key, max_waiting=args.max_waiting,
          warmup=args.warmup, shutdown_timeout=args.shutdown_timeout,
          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
          chat_template=template,
          lora_modules=args.lora_modules,
          runtime_lora_updating=args.enable_runtime_lora_updating,
          lora_allowed_dir=args.lora_allowed_dir)


COMMANDS = {"generate": _generate, "chat": _chat, "serve": _serve}
# What a command refuses from its flags and the model's files, before the weights load.
CHECKS_BEFORE_LOADING = {"chat": _needs_a_chat_template}


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, 1 on a user-facing error (one line on stderr; --debug shows the
    traceback), 130 on Ctrl-C."""
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("jpaged: %(message)s"))
    logging.getLogger("jpaged").addHandler(handler)
    logging.getLogger("jpaged").setLevel(logging.INFO)
    try:
        _simulate_cpu_devices(args.num_cpu_devices)
        if args.distributed:
            from jpaged.launch import initialize

            initialize()
        if check := CHECKS_BEFORE_LOADING.get(args.command):
            check(args)
        llm = _llm(args)
        COMMANDS[args.command](llm, args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        return 130
    except USER_ERRORS as error:
        if args.debug:
            raise
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1
    return 0


def _one_line(error: BaseException) -> str:
    """The error's message on one line (library messages may span several), else its type."""
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
