"""AsyncLLMEngine: an engine (an LLMEngine, or a DataParallelEngine: jpaged.engine.protocol)
driven by its own thread, for asyncio servers.

The engine is not thread-safe, so one background thread owns it: it runs the
commands queued by the event loop (add a request, abort one, read the
tokenizer), then one `step()`, and hands each output to the request's asyncio
queue with `loop.call_soon_threadsafe`. The event loop never waits for a
device step. When no request is unfinished the thread blocks on its command
queue instead of spinning.

    engine = AsyncLLMEngine(LLMEngine(config), max_waiting=256)
    async with await engine.generate("req-1", "Hello", SamplingParams()) as stream:
        async for delta in stream:
            ...
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from jpaged.engine.protocol import Engine, EngineState
from jpaged.inputs import PromptType
from jpaged.lora.request import LoRARequest
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jpaged")

T = TypeVar("T")
# What a request's queue receives: an output, or the exception that ends the request.
Delivery = RequestOutput | BaseException
Command = tuple[Callable[[Engine], object], concurrent.futures.Future | None]


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests: retry later."""


class EngineStoppedError(RuntimeError):
    """The engine no longer admits requests: it was shut down, or its thread failed."""


class RequestStream:
    """One request's outputs (deltas) as they come; iterate with `async for`.

    Closing the stream before the request finishes (`close()`, leaving `async
    with`, or the awaiting task being cancelled) aborts the request: the engine
    frees its blocks before its next step. An output with finish_reason "error"
    ends the stream normally; an engine that stops raises EngineStoppedError.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, deliveries: asyncio.Queue):
        self.request_id = request_id
        self._engine = engine
        self._deliveries = deliveries
        self._done = False
        self._has_output = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._deliveries.get()
        except BaseException:
            self.close()
            raise
        self._mark_running()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def _mark_running(self) -> None:
        if not self._has_output:
            self._has_output = True
            self._engine._num_waiting -= 1

    def close(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        self._mark_running()
        if not self._done:
            self._done = True
            self._engine._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()


class AsyncLLMEngine:
    """An LLMEngine or DataParallelEngine stepped by a background thread (a
    DataParallelEngine's step steps its busy replicas, each in a thread of its own);
    asyncio callers add and abort requests and read their outputs through
    per-request queues.

    max_waiting bounds the requests admitted but not yet producing output
    (counted on the event loop from `generate` to a request's first output,
    so prefilling requests count too: a conservative count of the waiting queue).
    on_idle: called on the engine thread every idle_s seconds while no request is
    unfinished and no command comes (a RequestMirror's `sync`, the heartbeat of the
    processes that follow it).
    """

    def __init__(self, engine: Engine, max_waiting: int = 1024, *,
                 on_idle: Callable[[], None] | None = None, idle_s: float = 5.0):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_idle, self.idle_s = on_idle, idle_s
        self.state: EngineState = engine.state()
        self.error: BaseException | None = None
        self._num_waiting = 0
        self._accepting = True
        self._stopping = False
        # (fn, future or None) to run on the engine thread; closed when the thread ends.
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        # request id -> its queue's put, called from the engine thread; engine thread only.
        self._sinks: dict[str, Callable[[Delivery], None]] = {}
        self._thread = threading.Thread(target=self._loop, name="jpaged-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests admitted that have produced no output yet."""
        return self._num_waiting

    # Event-loop side.

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams,
        *, cache_salt: str | None = None, lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Add a request and return the stream of its deltas (output_kind forced to DELTA).

        Raises, before any output: QueueFullError when max_waiting requests wait,
        EngineStoppedError after shutdown, and add_request's ValueError/TypeError
        for a bad prompt or parameters (nothing is queued then).
        """
        if not self._accepting or not self.is_running:
            raise EngineStoppedError("the engine is not accepting requests")
        if self._num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self._num_waiting} requests are waiting, the limit is "
                                 f"max_waiting={self.max_waiting}; retry later")
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        loop = asyncio.get_running_loop()
        deliveries: asyncio.Queue[Delivery] = asyncio.Queue()

        def sink(item: Delivery) -> None:
            loop.call_soon_threadsafe(deliveries.put_nowait, item)

        def add(engine: Engine) -> None:
            engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                               lora_request=lora_request)
            self._sinks[request_id] = sink

        self._num_waiting += 1
        try:
            await self.run(add)
        except BaseException as error:
            self._num_waiting -= 1
            if isinstance(error, asyncio.CancelledError):
                self._abort(request_id)  # the add may have run after all
            raise
        return RequestStream(self, request_id, deliveries)

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """fn(engine) on the engine thread, between steps; its result or its exception.

        For engine reads that are not thread-safe (tokenizing, chat templates).
        Raises EngineStoppedError once the engine thread has ended.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(fn, future)
        return await asyncio.wrap_future(future)

    def _submit(self, fn: Callable[[Engine], object],
                future: concurrent.futures.Future | None = None) -> None:
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine thread has ended")
            self._commands.put((fn, future))

    def _abort(self, request_id: str) -> None:
        def abort(engine: Engine) -> None:
            engine.abort(request_id)
            self._sinks.pop(request_id, None)

        with contextlib.suppress(EngineStoppedError):  # it aborted every request as it ended
            self._submit(abort)

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Stop admitting, abort every unfinished request (their streams raise
        EngineStoppedError) and join the engine thread, which ends after its
        current step. Idempotent."""
        self._accepting = False
        with contextlib.suppress(EngineStoppedError):
            self._submit(self._stop)
        self._thread.join(timeout)

    # Engine-thread side.

    def _stop(self, engine: Engine) -> None:
        self._stopping = True

    def _loop(self) -> None:
        try:
            while not self._stopping:
                idle = not self.engine.has_unfinished_requests()
                ran = self._run_commands(block=idle)
                if self.engine.has_unfinished_requests() and not self._stopping:
                    self._deliver(self.engine.step())
                elif idle and not ran and self.on_idle is not None:
                    self.on_idle()
                self._publish_state()
        except Exception as error:
            logger.exception("the engine thread failed; the server admits no more requests")
            self.error = error
        finally:
            stopped = EngineStoppedError(
                "the engine stopped" if self.error is None else f"the engine failed: {self.error}")
            self._close_commands(stopped)
            self._end_all(stopped)

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands; with block=True wait for the first one (at most idle_s
        with on_idle). Whether any ran."""
        timeout = self.idle_s if self.on_idle is not None else None
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return False
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _run_command(self, fn: Callable[[Engine], object],
                     future: concurrent.futures.Future | None) -> None:
        if future is None:
            fn(self.engine)
        elif future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(self.engine))
            except Exception as error:
                future.set_exception(error)

    def _close_commands(self, error: EngineStoppedError) -> None:
        """Admit no more commands; the waiting ones fail with `error`."""
        with self._lock:
            self._closed = True
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            try:
                sink(output)
            except RuntimeError:  # the event loop is closed: nobody is listening
                self.engine.abort(output.request_id)
                self._sinks.pop(output.request_id, None)

    def _end_all(self, error: BaseException) -> None:
        """Abort every request still listened to; their streams raise `error`."""
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                sink(error)
        for request_id in sinks:
            self.engine.abort(request_id)
        self._publish_state()

    def _publish_state(self) -> None:
        self.state = self.engine.state()
