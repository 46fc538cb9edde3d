"""Shared fixtures: tiny random Hugging Face models on disk and a paged-cache step builder.

The tiny models are written by transformers itself (the oracle), so loading them
exercises the same files a user would hand to jpaged.

`--shuffle-seed N` runs the test modules, and the tests within each, in an order
drawn from N, to show tests that depend on others' side effects. Tests that need
the default model (downloaded on first use) carry the `default_model` marker, so
an offline run can deselect them with `-m "not default_model"`.

Tests of tensor and data parallelism live in tests/multidevice and run in a
process of their own on 8 simulated CPU devices (tests/test_multidevice.py
starts it); the rest of the suite sees one device.

The Pallas kernels run in interpret mode, so that every one of them runs on a CPU.
`JPAGED_TEST_COMPILED=1` compiles instead the kernel of the machine's own backend
(the Triton kernel on a GPU, the Mosaic kernel on a TPU) and skips the tests of
another backend's kernel: the run that checks the kernels on an accelerator.
"""

from __future__ import annotations

import copy
import http.client
import json
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache
from transformers.convert_slow_tokenizer import bytes_to_unicode

import kernels_pallas
from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.step_shapes import BucketSizes
from jpaged.model.loader import default_model_directory, load_model

TINY_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "th"), ("i", "n"), ("e", "r"), ("Ġ", "a")]
END_OF_TEXT = "<|endoftext|>"
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SERVED_MODEL = "tiny"
SERVER_API_KEY = "test-key"
SERVER_MAX_BODY_BYTES = 64 * 1024
SERVER_MAX_WAITING = 256  # above the load test's 128 concurrent clients
# The engine of the server tests and their offline oracle: one padded shape for mixed
# steps and one for decode steps (64 tokens, 8 sequence rows, full-width block tables),
# so each engine compiles only those two.
SERVER_ENGINE = dict(block_size=8, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256, persistent_compilation_cache=False,
                     buckets=BucketSizes(min_num_tokens=64, min_num_seqs=8,
                                         min_blocks_per_seq=32))
# Fixtures that load the default model; a test that loads it itself carries the marker.
DEFAULT_MODEL_FIXTURES = {"smollm2", "smollm2_oracle"}
COMPILED_KERNELS = os.environ.get("JPAGED_TEST_COMPILED") == "1"
# tests/multidevice needs 8 simulated devices, set before JAX starts: test_multidevice.py
# runs it in a process of its own with this variable set, and no other run collects it.
MULTIDEVICE = os.environ.get("JPAGED_TEST_MULTIDEVICE") == "1"
collect_ignore = [] if MULTIDEVICE else ["multidevice"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle-seed", type=int, default=None, metavar="N",
                     help="run test modules, and the tests within each, in an order drawn from N")


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle-seed")
    return None if seed is None else f"shuffle seed: {seed}"


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as collected, before `-m` deselects by marker.
    if needs_default_model(item):
        item.add_marker(pytest.mark.default_model)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Last, so that no other hook (pytest groups tests by fixture parameters) reorders them.
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        items[:] = shuffled_by_module(items, random.Random(seed))


def kernel_interpret(implementation: str | None) -> bool:
    """`interpret=` for a test that runs the Pallas kernel `implementation` (None: the
    backend's own). True, unless JPAGED_TEST_COMPILED=1: then False, and a test of
    another backend's kernel is skipped (it cannot compile here)."""
    if not COMPILED_KERNELS:
        return True
    native = kernels_pallas.default_implementation(False)
    if implementation in ("triton", "tpu") and implementation != native:
        pytest.skip(f"the {implementation} kernel does not compile on {jax.default_backend()}")
    return False


def needs_default_model(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    return bool(fixtures & DEFAULT_MODEL_FIXTURES)


def shuffled_by_module(items: list[pytest.Item], rng: random.Random) -> list[pytest.Item]:
    """Modules in a random order, each one's tests in a random order. A module's tests stay
    together so that its module-scoped fixtures (an oracle's outputs, a loaded model) are
    built once, not once per visit."""
    by_module: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.path, []).append(item)
    modules = list(by_module.values())
    rng.shuffle(modules)
    for module_items in modules:
        rng.shuffle(module_items)
    return [item for module_items in modules for item in module_items]


@pytest.fixture(autouse=True)
def restore_compilation_cache_dir():
    """Undo a test's change of the process-wide persistent compilation cache: an engine
    created with persistent_compilation_cache=True sets it, and it would then serve later
    tests' compiles from disk (hiding recompilations they count)."""
    directory = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()


def tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """Byte-level BPE: 256 byte tokens, a few merges, and <|endoftext|> (263 tokens)."""
    pieces = list(bytes_to_unicode().values()) + ["".join(m) for m in TINY_MERGES] + [END_OF_TEXT]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    return transformers.GPT2Tokenizer(vocab=vocab, merges=TINY_MERGES, unk_token=END_OF_TEXT,
                                      bos_token=END_OF_TEXT, eos_token=END_OF_TEXT)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter, biases and norm weights included, a random value, so that
    each of them changes the logits (transformers initializes biases to 0, norms to 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)
    return model.eval()


def _save(model, tokenizer, directory: Path, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session", autouse=True)
def single_threaded_torch():
    """The PyTorch oracle runs on one thread: on a CPU shared with other processes its
    spin-waiting thread pool otherwise slows it down by an order of magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Untied Llama 3 style model with llama3 RoPE scaling, saved as sharded safetensors."""
    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), **TINY_SHAPE, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.LlamaForCausalLM(config), seed=0)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_llama"), max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2 model with q/k/v biases and tied embeddings, saved as one safetensors file."""
    tokenizer = tiny_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), **TINY_SHAPE, tie_word_embeddings=True,
        rope_theta=1e6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = randomize(transformers.Qwen2ForCausalLM(config), seed=1)
    return _save(model, tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def tiny_model_dir(request) -> Path:
    return request.getfixturevalue(request.param)


@dataclass
class PagedCacheBook:
    """Host-side block tables for tests: every sequence takes its blocks in the order of a
    random permutation of the pool (block 0 stays the null block), so logically adjacent
    blocks are physically scattered.
    """

    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    seed: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    free: list[int] = field(init=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        self.free = [int(b) for b in rng.permutation(np.arange(1, self.num_blocks))]

    def step(
        self, chunks: list[tuple[int, list[int]]], num_tokens: int, num_seqs: int
    ) -> tuple[np.ndarray, AttentionMetadata]:
        """Append each (seq_id, new_tokens) chunk to its sequence; padded to num_tokens tokens
        and num_seqs sequences. Returns (input_ids int32 [num_tokens], metadata)."""
        assert sum(len(t) for _, t in chunks) <= num_tokens and len(chunks) <= num_seqs
        ids, slots, positions, context_lens, starts = [], [], [], [], [0]
        tables = np.zeros((num_seqs, self.max_blocks_per_seq), np.int32)
        for row, (seq_id, tokens) in enumerate(chunks):
            start = self.lengths.get(seq_id, 0)
            table = self.tables.setdefault(seq_id, [])
            for pos in range(start, start + len(tokens)):
                block, offset = divmod(pos, self.block_size)
                if block == len(table):
                    table.append(self.free.pop())
                slots.append(table[block] * self.block_size + offset)
                positions.append(pos)
            self.lengths[seq_id] = start + len(tokens)
            ids += tokens
            context_lens.append(self.lengths[seq_id])
            starts.append(starts[-1] + len(tokens))
            tables[row, : len(table)] = table
        logits_indices = [end - 1 for end in starts[1:]]
        padding = num_tokens - len(ids)
        pad_seqs = num_seqs - len(chunks)
        metadata = AttentionMetadata(
            slot_mapping=np.array(slots + [i % self.block_size for i in range(padding)], np.int32),
            positions=np.array(positions + [0] * padding, np.int32),
            block_tables=tables,
            context_lens=np.array(context_lens + [0] * pad_seqs, np.int32),
            query_start_loc=np.array(starts + [starts[-1]] * pad_seqs, np.int32),
            logits_indices=np.array(logits_indices + [0] * pad_seqs, np.int32),
        )
        return np.array(ids + [0] * padding, np.int32), metadata


def _model_step(graphdef, state, input_ids, kv_cache, metadata):
    """The runner's path through the model with the reference kernels: logits f32 [B, vocab]
    at metadata.logits_indices, and the updated cache."""
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model.hidden_states(input_ids, kv_cache, metadata)
    return model.compute_logits(hidden[metadata.logits_indices]), kv_cache


# One jitted model step, the cache donated: model_step(*nnx.split(model), input_ids, ...).
model_step = jax.jit(_model_step, static_argnums=0, donate_argnums=3)


@pytest.fixture
def jpaged_logger_restored():
    """The CLI sends the jpaged logger to stderr; leave no handler behind for other tests."""
    logger = logging.getLogger("jpaged")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture
def paged_cache_book():
    return PagedCacheBook


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct), as jpaged loads it: (model, config, tokenizer)."""
    return load_model("smollm2")


def greedy_continuations(model_dir: Path, prompts: list[list[int]], num_tokens: int
                         ) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly num_tokens long (EOS
    suppressed), one prompt at a time: the oracle for the engine's greedy outputs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                 pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="session")
def smollm2_oracle():
    """The default model in transformers, from the same converted float32 weights."""
    directory = default_model_directory()
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


# The HTTP server on the tiny model.


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_llama_dir):
    """The tiny Llama as jpaged loads it, with a ChatML chat template: (model, config,
    tokenizer)."""
    model, config, tokenizer = load_model(tiny_llama_dir)
    tokenizer.chat_template = CHATML
    return model, config, tokenizer


@pytest.fixture(scope="session")
def offline(tiny_chat_model):
    """The server tests' oracle: an offline LLM with the server's engine settings."""
    from jpaged.entrypoints.llm import LLM

    return LLM(SERVED_MODEL, loaded=tiny_chat_model, **SERVER_ENGINE)


@pytest.fixture(scope="session")
def server(tiny_chat_model):
    """(base_url, AsyncLLMEngine) of the OpenAI server (uvicorn in a thread, on a free
    loopback port) over a SERVER_ENGINE engine, shared by the server tests: one engine
    compiles its steps once. The engine gets its own tokenizer copy, since the offline
    oracle's runs in the test thread. Tests that change max_waiting restore it."""
    import uvicorn

    from jpaged.engine.async_engine import AsyncLLMEngine
    from jpaged.engine.llm_engine import EngineConfig, LLMEngine
    from jpaged.entrypoints.server import build_app

    model, config, tokenizer = tiny_chat_model
    engine = LLMEngine(EngineConfig(model=SERVED_MODEL, **SERVER_ENGINE),
                       loaded=(model, config, copy.deepcopy(tokenizer)))
    async_engine = AsyncLLMEngine(engine, max_waiting=SERVER_MAX_WAITING)
    app = build_app(async_engine, SERVED_MODEL, api_key=SERVER_API_KEY,
                    max_body_bytes=SERVER_MAX_BODY_BYTES)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]})
    thread.start()
    while not uvicorn_server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine
    uvicorn_server.should_exit = True
    thread.join(30)
    assert not async_engine.is_running  # the lifespan's end shut the engine down


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case
    text: str

    def json(self):
        return json.loads(self.text)


def http_connection(base_url: str, timeout: float = 60) -> http.client.HTTPConnection:
    host, port = base_url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def http_request(base_url: str, method: str, path: str, body: bytes | None = None,
                 headers: dict | None = None) -> Reply:
    connection = http_connection(base_url)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                     response.read().decode())
    finally:
        connection.close()


def metric(base_url: str, name: str) -> float:
    """One sample's value from /metrics."""
    for line in http_request(base_url, "GET", "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """Until the AsyncLLMEngine's published state shows no request and no block held."""
    deadline = time.monotonic() + timeout
    while engine.state.kv_blocks_used or engine.state.num_running or engine.state.num_waiting:
        assert time.monotonic() < deadline, f"the engine is still busy: {engine.state}"
        time.sleep(0.01)
