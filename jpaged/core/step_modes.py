"""Which step modes and features combine: one table, checked when the config is built.

An engine steps in one of three modes (`StepMode`): a single step per schedule, async
scheduling (the next step scheduled while the device runs this one), or the decode loop
(`num_decode_steps` > 1 decode steps on the device per schedule). `TABLE` says, for
every mode and feature, whether they combine:

    supported   the feature runs in that mode as it does in single steps
    fallback    some steps run another way (a step with a beam search runs single under
                the decode loop): `ModeFallbacks` logs the first and counts them all
    conflict    the two cannot run together. If the user set both, the config raises
                ValueError naming both settings; if the mode came from a default (the
                machine's num_decode_steps), the mode gives way, logged and counted

`FEATURE_PAIRS` says the same of the features that do not combine with each other; in
a conflict there, the second feature gives way when it came from a default (prefix
caching, left as None, is off under Orca's allocations). The two modes beside single
steps exclude each other: a default decode loop gives way to async scheduling.

`check_conflicts` runs as an EngineConfig is made (settings the user gave that
conflict); `resolve` as the engine starts (`EngineConfig.with_machine_defaults`, which
knows the machine's defaults and the model's layer windows): it decides what was left
to the engine and raises for what conflicts with the model. docs/architecture.md
renders the tables.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jpaged.memory.kv_cache_groups import KVCacheGroups

if TYPE_CHECKING:
    from jpaged.engine.config import EngineConfig

logger = logging.getLogger("jpaged")


class StepMode(enum.Enum):
    """How the engine runs its steps (one mode per engine)."""

    SINGLE_STEP = "single step"
    ASYNC_SCHEDULING = "async scheduling"
    DECODE_LOOP = "decode loop"


class Feature(enum.Enum):
    """What a config (or a request: beam search, n > 1, prefill, penalties, a grammar)
    turns on."""

    NGRAM = "n-gram speculation"
    DRAFT_MODEL = "draft-model speculation"
    BEAM_SEARCH = "beam search"
    PARALLEL_SAMPLING = "n > 1"
    PREFILL = "prompt tokens"
    PENALTIES = "penalties"
    STRUCTURED_OUTPUT = "structured outputs"
    SLIDING_WINDOW = "sliding windows"
    HYBRID_KV_GROUPS = "hybrid KV cache groups"
    QUANTIZED_KV = "quantized KV cache"
    TENSOR_PARALLEL = "tensor parallelism"
    DATA_PARALLEL = "data parallelism"
    SEVERAL_PROCESSES = "several processes"
    ORCA = "Orca allocation"
    PREFIX_CACHING = "prefix caching"
    SWAP = "swap preemption"
    LORA = "LoRA adapters"


class Outcome(enum.Enum):
    SUPPORTED = "supported"
    FALLBACK = "fallback"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Cell:
    """outcome; why: the reason (a fallback's or a conflict's); instead: what runs instead
    (a fallback's steps, or a conflict's setting that gives way)."""

    outcome: Outcome
    why: str = ""
    instead: str = ""


SUPPORTED = Cell(Outcome.SUPPORTED)


def _fallback(instead: str, why: str) -> Cell:
    return Cell(Outcome.FALLBACK, why, instead)


def _conflict(why: str, instead: str = "") -> Cell:
    return Cell(Outcome.CONFLICT, why, instead)


_PROPOSALS_EACH_STEP = "proposals are made from the tokens of the step before and verified on " \
                       "the host after every step"
_NEEDED_NEXT = "is finished before the next step is scheduled"

TABLE: dict[StepMode, dict[Feature, Cell]] = {
    StepMode.SINGLE_STEP: dict.fromkeys(Feature, SUPPORTED),
    StepMode.ASYNC_SCHEDULING: dict.fromkeys(Feature, SUPPORTED) | {
        Feature.NGRAM: _conflict(_PROPOSALS_EACH_STEP),
        Feature.DRAFT_MODEL: _conflict(_PROPOSALS_EACH_STEP),
        Feature.BEAM_SEARCH: _fallback(f"a step with a beam search {_NEEDED_NEXT}",
                                       "the next schedule needs the beams it chooses"),
        Feature.PARALLEL_SAMPLING: _fallback(
            f"the step that forks a prompt into its samples {_NEEDED_NEXT}",
            "the next schedule needs the samples"),
        Feature.PENALTIES: _fallback(f"a step that draws with penalties {_NEEDED_NEXT}",
                                     "the next draw's penalties count its tokens"),
        Feature.STRUCTURED_OUTPUT: _fallback(
            f"a step that draws with a grammar {_NEEDED_NEXT}",
            "the next draw's token mask follows its tokens"),
    },
    StepMode.DECODE_LOOP: dict.fromkeys(Feature, SUPPORTED) | {
        Feature.NGRAM: _conflict(_PROPOSALS_EACH_STEP, "single steps"),
        Feature.DRAFT_MODEL: _conflict(_PROPOSALS_EACH_STEP, "single steps"),
        Feature.BEAM_SEARCH: _fallback("a step with a beam search runs as a single step",
                                       "beams are chosen on the host"),
        Feature.PARALLEL_SAMPLING: _fallback(
            "the step that forks a prompt into its samples runs as a single step",
            "forks are the host's; the samples loop after it"),
        Feature.PREFILL: _fallback("a step with prompt tokens runs as a single step",
                                   "the loop only decodes"),
        Feature.STRUCTURED_OUTPUT: _fallback(
            "a step that draws with a grammar runs as a single step",
            "token masks are filled on the host after every token"),
        Feature.HYBRID_KV_GROUPS: _conflict(
            "the loop grows one block table per sequence, and KV cache groups hold one per "
            "group, whose windows free blocks on the host (disable_hybrid_kv_cache_manager="
            "True keeps every block in one group)", "single steps"),
        Feature.ORCA: _conflict("the loop takes blocks from the free queue as tokens arrive, "
                                "and a reservation holds its blocks from admission",
                                "single steps"),
        Feature.LORA: _conflict("the loop's steps take no adapter slots per row",
                                "single steps"),
    },
}

# The pairs of features that do not simply combine; in a conflict the second gives way.
FEATURE_PAIRS: dict[tuple[Feature, Feature], Cell] = {
    (Feature.ORCA, Feature.PREFIX_CACHING): _conflict(
        "Orca's reservations keep no prefix cache", "prefix caching off"),
    (Feature.ORCA, Feature.SLIDING_WINDOW): _conflict(
        "a reservation holds every block of a sequence until it ends",
        "every block kept (disable_hybrid_kv_cache_manager=True)"),
    (Feature.ORCA, Feature.SWAP): _conflict("Orca's reservations have no swap space"),
    (Feature.DRAFT_MODEL, Feature.TENSOR_PARALLEL): _conflict(
        "the draft model runs on one device (a job of several processes needs a mesh too)"),
    (Feature.DRAFT_MODEL, Feature.DATA_PARALLEL): _conflict("the draft model runs on one device"),
    (Feature.DRAFT_MODEL, Feature.LORA): _conflict(
        "the draft model has no adapters, so it would propose the base model's tokens"),
    (Feature.NGRAM, Feature.BEAM_SEARCH): _fallback(
        "a beam search gets no proposals", "its beams are chosen on the host"),
    (Feature.DRAFT_MODEL, Feature.BEAM_SEARCH): _fallback(
        "a beam search gets no proposals", "its beams are chosen on the host"),
}

# The two modes beside single steps exclude each other; a default decode loop gives way.
MODES_CONFLICT = _conflict("async scheduling overlaps single steps, and the decode loop "
                           "runs several steps at once", "single steps")

Setting = StepMode | Feature


def step_mode(config: EngineConfig) -> StepMode:
    """The mode of a resolved config (`EngineConfig.with_machine_defaults`)."""
    if config.async_scheduling:
        return StepMode.ASYNC_SCHEDULING
    return StepMode.DECODE_LOOP if config.num_decode_steps > 1 else StepMode.SINGLE_STEP


def fallback_name(setting: Setting, other: Setting) -> str:
    """The key a fallback is counted under: "decode_loop/beam_search" (a step with a beam
    search ran single under the decode loop), "prefix_caching/orca" (prefix caching gave
    way to an Orca allocation)."""
    return f"{setting.name.lower()}/{other.name.lower()}"


@dataclass
class ModeFallbacks:
    """How often each fallback of the tables happened (keys: `fallback_name`); the first of
    each kind is logged (logger "jpaged", info)."""

    counts: Counter[str] = field(default_factory=Counter)

    def note(self, setting: Setting, other: Setting, message: str | None = None) -> None:
        """`setting` ran another way because of `other`: a step mode's step (setting a mode,
        other a feature of TABLE), or a default that gave way. message: what to log the
        first time; by default the table's fallback."""
        name = fallback_name(setting, other)
        if name not in self.counts:
            logger.info("%s", message or _step_fallback_message(setting, other))
        self.counts[name] += 1


def _step_fallback_message(setting: Setting, other: Feature) -> str:
    """The table's fallback for `setting`'s steps with `other` (a mode's row, or a pair
    of features)."""
    cell = TABLE[setting][other] if isinstance(setting, StepMode) else FEATURE_PAIRS[
        setting, other]
    return f"{setting.value} with {other.value}: {cell.instead} ({cell.why})"


@dataclass(frozen=True)
class Given:
    """A mode or feature a config turns on: the setting that does, and whether it is the
    engine's default (a field left as None) rather than the user's."""

    setting: str
    by_default: bool = False


def _settings_on(config: EngineConfig, default_decode_steps: int = 1,
                layer_windows: tuple[int | None, ...] = ()) -> dict[Setting, Given]:
    """The modes and the features that can conflict that `config` turns on, as the user
    gave it (fields left as None are the engine's to decide). default_decode_steps: the
    machine's num_decode_steps; layer_windows: the model's, once known."""
    on: dict[Setting, Given] = {}
    if config.async_scheduling:
        on[StepMode.ASYNC_SCHEDULING] = Given("async_scheduling=True")
    steps = config.num_decode_steps or default_decode_steps
    if steps > 1:
        on[StepMode.DECODE_LOOP] = Given(f"num_decode_steps={steps}",
                                         by_default=config.num_decode_steps is None)
    spec = config.speculative_config
    if spec is not None:
        feature = Feature.NGRAM if spec.method == "ngram" else Feature.DRAFT_MODEL
        on[feature] = Given(f"speculative_config['method']={spec.method!r}")
    if config.tensor_parallel_size > 1 or config.mesh is not None:
        on[Feature.TENSOR_PARALLEL] = Given(
            f"tensor_parallel_size={config.tensor_parallel_size}" if config.mesh is None
            else f"mesh={dict(config.mesh.shape)}")
    if config.data_parallel_size > 1:
        on[Feature.DATA_PARALLEL] = Given(f"data_parallel_size={config.data_parallel_size}")
    if config.allocation != "paged":
        on[Feature.ORCA] = Given(f"allocation={config.allocation!r}")
    if config.enable_prefix_caching is not False:
        on[Feature.PREFIX_CACHING] = Given("enable_prefix_caching=True",
                                           by_default=config.enable_prefix_caching is None)
    if config.preemption_mode == "swap":
        on[Feature.SWAP] = Given("preemption_mode='swap'")
    if config.enable_lora:
        on[Feature.LORA] = Given("enable_lora=True")
    on |= _window_settings(config, layer_windows)
    return on


def _window_settings(config: EngineConfig, layer_windows: tuple[int | None, ...]
                     ) -> dict[Setting, Given]:
    """Sliding windows that free their blocks, and the KV cache groups of a model that
    mixes local and global layers, unless disable_hybrid_kv_cache_manager keeps every
    block."""
    if config.disable_hybrid_kv_cache_manager or all(w is None for w in layer_windows):
        return {}
    given = Given("disable_hybrid_kv_cache_manager=False",
                  by_default=config.disable_hybrid_kv_cache_manager is None)
    on: dict[Setting, Given] = {Feature.SLIDING_WINDOW: given}
    if KVCacheGroups.of(layer_windows).num_groups > 1:
        on[Feature.HYBRID_KV_GROUPS] = Given(
            f"the model's local and global layers in KV cache groups ({given.setting})",
            given.by_default)
    return on


def _conflicts(on: dict[Setting, Given]) -> list[tuple[Setting, Setting, Cell]]:
    """(the setting that would give way, the other, their cell) of every conflict between
    the settings on: the features' first, as a feature that gives way there may end
    another conflict (kept windows make no KV cache groups)."""
    found = [(second, first, cell) for (first, second), cell in FEATURE_PAIRS.items()
             if cell.outcome is Outcome.CONFLICT and first in on and second in on]
    for mode, row in TABLE.items():
        found += [(mode, feature, cell) for feature, cell in row.items()
                  if cell.outcome is Outcome.CONFLICT and mode in on and feature in on]
    if StepMode.ASYNC_SCHEDULING in on and StepMode.DECODE_LOOP in on:
        found.append((StepMode.DECODE_LOOP, StepMode.ASYNC_SCHEDULING, MODES_CONFLICT))
    return found


def _conflict_error(on: dict[Setting, Given], setting: Setting, other: Setting,
                    cell: Cell) -> ValueError:
    return ValueError(f"{on[setting].setting} conflicts with {on[other].setting}: {cell.why}")


def check_conflicts(config: EngineConfig) -> None:
    """ValueError naming both settings if two settings the user gave conflict."""
    on = _settings_on(config)
    for setting, other, cell in _conflicts(on):
        if not on[setting].by_default and not on[other].by_default:
            raise _conflict_error(on, setting, other, cell)


def resolve(config: EngineConfig, default_decode_steps: int,
            layer_windows: tuple[int | None, ...], fallbacks: ModeFallbacks) -> dict:
    """The values of the settings `config` leaves to the engine: num_decode_steps,
    enable_prefix_caching, disable_hybrid_kv_cache_manager. A default that conflicts gives
    way (noted in `fallbacks`); ValueError where a setting the user gave conflicts (with
    the model's layer windows too)."""
    on = _settings_on(config, default_decode_steps, layer_windows)
    for setting, other, cell in _conflicts(on):
        if setting not in on or other not in on:
            continue  # one of them gave way already
        if not on[setting].by_default:
            raise _conflict_error(on, setting, other, cell)
        fallbacks.note(setting, other, f"{on[setting].setting} (the default) gives way to "
                                       f"{on[other].setting}: {cell.instead}, as {cell.why}")
        del on[setting]
        if setting is Feature.SLIDING_WINDOW:
            on.pop(Feature.HYBRID_KV_GROUPS, None)  # groups exist only while windows free
    windows_kept = any(w is not None for w in layer_windows) and Feature.SLIDING_WINDOW not in on
    return {
        "num_decode_steps": ((config.num_decode_steps or default_decode_steps)
                             if StepMode.DECODE_LOOP in on else 1),
        "enable_prefix_caching": Feature.PREFIX_CACHING in on,
        "disable_hybrid_kv_cache_manager": bool(config.disable_hybrid_kv_cache_manager)
        or windows_kept,
    }
