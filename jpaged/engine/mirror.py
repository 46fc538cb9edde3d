"""Serving from a job of several processes: process 0 takes the requests, the others
follow it.

Requests reach one process (the HTTP server runs on process 0), but every process
of a multi-controller job must see them in the same order (jpaged.engine.lockstep).
`RequestMirror` wraps process 0's engine: it writes down every request added and
aborted, and before each step sends that journal to the other processes, which
run `follow`: add and abort the same requests in the same order, then step.
Between steps, while no request runs, process 0 sends a heartbeat now and then
(`sync`), so that the others never wait in a collective longer than a few
seconds; `stop` ends them.
"""

from __future__ import annotations

import pickle
import signal
from typing import Any

import jax

from jpaged.engine.input_processor import EngineRequest
from jpaged.engine.lockstep import ProcessGroup
from jpaged.engine.protocol import Engine, EngineState
from jpaged.inputs import PromptType
from jpaged.lora.request import LoRARequest
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams

# Seconds an idle server waits between heartbeats (RequestMirror.sync).
HEARTBEAT_S = 5.0
STEP, SYNC, STOP = "step", "sync", "stop"
# The journal's entries by name: the engine call every other process makes.
JOURNAL_CALLS = {"add": "add_request", "abort": "abort", "remove_lora": "remove_lora"}


def broadcast(group: ProcessGroup, message: Any = None) -> Any:
    """Process 0's `message` on every process of `group` (each must call this in turn)."""
    payload = pickle.dumps(message) if jax.process_index() == 0 else b""
    return pickle.loads(group.allgather_bytes(payload)[0])


class RequestMirror:
    """Process 0's engine (the Engine protocol), whose requests every process adds."""

    def __init__(self, engine: Engine):
        if jax.process_index() != 0:
            raise ValueError(f"requests are taken by process 0; process "
                             f"{jax.process_index()} follows it (jpaged.engine.mirror.follow)")
        self.engine = engine
        self.config, self.tokenizer = engine.config, engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.group = ProcessGroup(jax.devices())
        self._journal: list[tuple] = []

    def add_request(self, request_id: str, prompt: PromptType | EngineRequest,
                    params: SamplingParams | BeamSearchParams | None = None, *,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """`Engine.add_request`; the request, processed, goes to the others with the next
        step (only once it was accepted here: they would refuse it too)."""
        request = prompt if isinstance(prompt, EngineRequest) else self.engine.process_request(
            request_id, prompt, params, cache_salt=cache_salt, lora_request=lora_request)
        self.engine.add_request(request_id, request)
        self._journal.append(("add", request_id, request))

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._journal.append(("abort", request_id))

    def lora_adapter(self, lora_request: LoRARequest):
        return self.engine.lora_adapter(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        self._journal.append(("remove_lora", lora_name))
        return self.engine.remove_lora(lora_name)

    def step(self) -> list[RequestOutput]:
        self._send(STEP)
        return self.engine.step()

    def sync(self) -> None:
        """Send the journal without a step: the others' heartbeat while no request runs."""
        self._send(SYNC)

    def stop(self) -> None:
        """End `follow` on every other process; the mirror takes no more calls."""
        self._send(STOP)

    def _send(self, command: str) -> None:
        journal, self._journal = self._journal, []
        broadcast(self.group, (journal, command))

    # The rest of the Engine protocol is this process's engine's.

    @property
    def stats(self) -> Any:
        return self.engine.stats

    @property
    def last_step_error(self) -> BaseException | None:
        return self.engine.last_step_error

    def process_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | BeamSearchParams | None = None, *,
                        cache_salt: str | None = None,
                        lora_request: LoRARequest | None = None) -> EngineRequest:
        return self.engine.process_request(request_id, prompt, params, cache_salt=cache_salt,
                                           lora_request=lora_request)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], **options) -> list[int]:
        return self.engine.apply_chat_template(messages, **options)

    def warmup(self) -> int:
        """The engine's warm-up; every other process must run its own at the same time."""
        return self.engine.warmup()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests()

    def state(self) -> EngineState:
        return self.engine.state()


def follow(engine: Engine) -> None:
    """Run process 0's requests (on a process other than 0) until its mirror stops.

    SIGINT and SIGTERM are ignored: process 0 decides when the job ends, and a
    launcher passes a signal on to every process."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    group = ProcessGroup(jax.devices())
    while True:
        journal, command = broadcast(group)
        for call, *args in journal:
            getattr(engine, JOURNAL_CALLS[call])(*args)
        if command == STOP:
            return
        if command == STEP:
            engine.step()
