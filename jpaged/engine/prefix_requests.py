"""Reserved prefixes in an engine: their KV computed by internal requests, their blocks then
held by the KV cache manager (jpaged.memory.reserved_prefixes).

`reserve` runs the prefix as a prompt of its own (one greedy output token, which no
caller sees) through the engine's ordinary steps, so its blocks are computed and
registered in the prefix cache as any prompt's are, then holds them. The internal
requests count in the engine's statistics as the requests they are.

A step that loses the KV cache (jpaged.engine.engine_core) loses every reserved prefix's
blocks too (BlockManager.reset_prefix_cache): `recompute_lost` queues each prefix's
prompt again, and once that request finishes the manager holds its new blocks under the
same prefix id (`restore`). Requests admitted meanwhile compute the prefix themselves.
A recomputation that fails for another reason than a lost cache leaves its prefix lost,
holding nothing, with an error logged, until it is released. One whose blocks were
evicted before the host could hold them (under async scheduling the next step is
scheduled before the host sees a request end) runs again.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from jpaged.memory.reserved_prefixes import PrefixNotCached
from jpaged.outputs import RequestOutput, ReservedPrefix
from jpaged.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jpaged.engine.llm_engine import LLMEngine

logger = logging.getLogger("jpaged")

# A prefix's prefill: one greedy token, reported only once finished. Seeded, so that it
# draws no seed from the engine's stream (which would shift the user's unseeded requests').
PREFILL = SamplingParams(temperature=0.0, seed=0, max_tokens=1,
                         output_kind=RequestOutputKind.FINAL_ONLY)


class PrefixRequests:
    """The internal requests of one engine that compute reserved prefixes' KV."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # Internal request id -> the lost prefix it restores (None: one `reserve` awaits).
        self._computing: dict[str, int | None] = {}
        self._finished: dict[str, RequestOutput] = {}  # what `reserve` awaits, once finished
        self._request_ids = itertools.count()

    def reserve(self, token_ids: list[int], cache_salt: str | None) -> ReservedPrefix:
        """Compute the prefix's KV, stepping the engine, then hold its full blocks. Raises,
        reserving nothing, what BlockManager.check_reservable raises, ValueError while a
        caller's request is in flight (its outputs would go to no one), and the error of
        a step that failed the prefix."""
        manager = self.engine.block_manager
        manager.check_reservable(token_ids, cache_salt)
        in_flight = self.engine.num_unfinished_requests() - len(self._computing)
        if in_flight:
            raise ValueError(f"a prefix is reserved between requests: {in_flight} requests "
                             "are in flight, whose outputs its steps would take")
        request_id = self._compute(token_ids, cache_salt, None)
        self.engine.last_step_error = None
        try:
            while request_id not in self._finished:
                self.engine.step()
        except BaseException:  # a fatal step error, or an interrupt
            if request_id in self._computing:
                del self._computing[request_id]
                self.engine.abort(request_id)
            raise
        if self._finished.pop(request_id).outputs[0].finish_reason == "error":
            raise self.engine.last_step_error or RuntimeError(
                "the prefix's logits were not finite: nothing is reserved")
        return manager.reserve(token_ids, cache_salt)

    def release(self, prefix_id: int) -> None:
        """Release the prefix (BlockManager.release), withdrawing its recomputation."""
        self.engine.block_manager.release(prefix_id)
        for request_id, restores in list(self._computing.items()):
            if restores == prefix_id:
                del self._computing[request_id]
                self.engine.abort(request_id)

    def users_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` less the internal requests' (no caller sees them); a finished one ends
        its prefix's computation."""
        if not self._computing:
            return outputs
        kept = []
        for output in outputs:
            if output.request_id not in self._computing:
                kept.append(output)
            elif output.finished:
                restores = self._computing.pop(output.request_id)
                if restores is None:
                    self._finished[output.request_id] = output
                else:
                    self._restore(restores, output)
        return kept

    def recompute_lost(self) -> None:
        """Queue the prompt of every lost reserved prefix not queued already (the KV cache
        was lost)."""
        queued = set(self._computing.values())
        for reservation in self.engine.block_manager.reserved_prefixes:
            if reservation.is_lost and reservation.prefix_id not in queued:
                self._compute(reservation.token_ids, reservation.cache_salt,
                              reservation.prefix_id)

    def _restore(self, prefix_id: int, output: RequestOutput) -> None:
        manager = self.engine.block_manager
        if output.outputs[0].finish_reason == "error":
            logger.error("reserved prefix %d: recomputing its KV failed; it holds no blocks "
                         "until it is released and reserved again", prefix_id)
            return
        try:
            prefix = manager.restore(prefix_id)
        except PrefixNotCached:
            reservation = manager.reserved_prefixes.get(prefix_id)
            self._compute(reservation.token_ids, reservation.cache_salt, prefix_id)
            return
        logger.info("reserved prefix %d: its KV recomputed, %d blocks held again", prefix_id,
                    prefix.num_blocks)

    def _compute(self, token_ids: tuple[int, ...] | list[int], cache_salt: str | None,
                 restores: int | None) -> str:
        request_id = f"jpaged-reserved-prefix-{next(self._request_ids)}"
        self.engine.add_request(request_id, {"prompt_token_ids": list(token_ids)}, PREFILL,
                                cache_salt=cache_salt)
        self._computing[request_id] = restores
        return request_id
