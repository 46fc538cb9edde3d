"""What one engine step costs on a device: a roofline per part, calibrated where it can be.

A step's time is a fixed overhead plus, for each part of the model's work, the
longer of its compute time and its memory time (a roofline per part):

    seconds = overhead_s
              + max(linear FLOPs / compute rate,    weight bytes / memory rate)
              + max(attention FLOPs / compute rate, KV bytes / memory rate)
              + all-reduce bytes / interconnect rate       (tensor parallel only)

where compute rate = chips x peak FLOP/s x `Efficiency.compute` and memory rate =
chips x peak bytes/s x `Efficiency.bandwidth`. Each part's count is in its
function's docstring. The shape is the engine's: tokens and logit rows padded to
the bucket it compiles (jpaged.core.step_shapes), each sequence's attention over
the KV tokens it holds, read in whole blocks, a sliding window's layers over the
window only, a quantized cache at its bytes per token.

Devices are data (`DEVICES`, each with its public source); a device's achieved
fractions are an `Efficiency` per phase (decode steps, and steps that compute a
prompt chunk), assumed for a device nobody measured and fitted (`fit`) to step
times an engine recorded on one that was: the project's CPU in the sweep's
accelerators study, a GPU or TPU in benchmarks.accelerator.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from experiments.device_peaks import peaks
from jpaged.core.step_shapes import BucketSizes, padded_sizes

GIB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator (or a slice of `num_chips` running tensor parallel).

    peak_flops: dense bfloat16/float16 FLOP/s of one chip (float32 for a CPU).
    peak_bandwidth: bytes/s of one chip's main memory.
    memory_bytes: one chip's main memory.
    interconnect_bandwidth: bytes/s one chip sends to its ring neighbour in an
        all-reduce (NVLink, ICI); unused on one chip.
    """

    name: str
    peak_flops: float
    peak_bandwidth: float
    memory_bytes: float
    source: str
    num_chips: int = 1
    interconnect_bandwidth: float = 0.0


def _datasheet_device(name: str, device_kind: str, memory_bytes: float, memory: str, *,
                      num_chips: int = 1, interconnect_bandwidth: float,
                      interconnect: str) -> Device:
    """A Device whose peaks are experiments.device_peaks' for device_kind."""
    known = peaks(device_kind)
    return Device(name, peak_flops=known.flops, peak_bandwidth=known.bandwidth,
                  memory_bytes=memory_bytes, num_chips=num_chips,
                  interconnect_bandwidth=interconnect_bandwidth,
                  source=f"{known.source}; {memory}; {interconnect}")


DEVICES = {
    "a100-40gb": _datasheet_device(
        "NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB", 40 * GIB, "40 GB",
        interconnect_bandwidth=300e9, interconnect="NVLink 600 GB/s (300 GB/s each way)"),
    "h100": _datasheet_device(
        "NVIDIA H100-SXM5-80GB", "H100", 80 * GIB, "80 GB",
        interconnect_bandwidth=450e9, interconnect="NVLink 900 GB/s"),
    "h200": _datasheet_device(
        "NVIDIA H200-SXM-141GB", "H200", 141e9, "141 GB",
        interconnect_bandwidth=450e9, interconnect="NVLink 900 GB/s"),
    "tpu-v5e-4": _datasheet_device(
        "Google TPU v5e-4 (four chips)", "TPU v5e", 16 * GIB, "16 GiB HBM per chip",
        num_chips=4, interconnect_bandwidth=100e9,
        interconnect="ICI 1,600 Gbps per chip (100 GB/s each way)"),
    "tpu-v6e": _datasheet_device(
        "Google TPU v6e (one chip)", "TPU v6e", 32 * GIB, "32 GiB HBM per chip",
        interconnect_bandwidth=224e9, interconnect="ICI 3,584 Gbps per chip"),
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes as a step's cost sees them.

    gated_mlp: three hidden x intermediate matrices per layer (SwiGLU), else two (OPT).
    dtype_bytes: bytes of a weight and an activation element.
    kv_head_bytes: bytes of one token's K (or V) of one KV head, scales included;
        None: head_dim elements of dtype_bytes.
    layer_windows: each layer's sliding window (None: global); () every layer global.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool = True
    dtype_bytes: int = 2
    kv_head_bytes: int | None = None
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, config, name: str, dtype_bytes: int) -> ModelShape:
        """The shape of a jpaged LlamaConfig (its sliding layers included)."""
        windows = ()
        if config.sliding_window is not None:
            types = config.layer_types or ("sliding_attention",) * config.num_layers
            windows = tuple(config.sliding_window if kind == "sliding_attention" else None
                            for kind in types)
        return cls(name, config.num_layers, config.hidden_size, config.num_heads,
                   config.num_kv_heads, config.head_dim, config.intermediate_size,
                   config.vocab_size, dtype_bytes=dtype_bytes, layer_windows=windows)

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matmuls: q and o (hidden x heads x head_dim), k and v
        (hidden x KV heads x head_dim), and the MLP's two or three matrices."""
        attention = 2 * self.hidden_size * self.head_dim * (self.num_heads + self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return attention + mlp

    @property
    def weight_bytes(self) -> int:
        """Bytes a step reads: every layer's matmuls and the output embedding (the
        input embedding gives a few rows only)."""
        return (self.num_layers * self.layer_params
                + self.vocab_size * self.hidden_size) * self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer, over its KV heads."""
        return 2 * self.num_kv_heads * (self.kv_head_bytes or self.head_dim * self.dtype_bytes)

    @property
    def layers_by_window(self) -> dict[int | None, int]:
        """How many layers have each sliding window (None: global attention)."""
        windows = self.layer_windows or (None,) * self.num_layers
        return {window: windows.count(window) for window in dict.fromkeys(windows)}


# Hugging Face configs of the models the studies project (facebook/opt-13b,
# huggyllama/llama-13b, meta-llama/Meta-Llama-3-8B), bfloat16/float16 weights.
OPT_13B = ModelShape("OPT-13B", num_layers=40, hidden_size=5120, num_heads=40,
                     num_kv_heads=40, head_dim=128, intermediate_size=20480, vocab_size=50272,
                     gated_mlp=False)
LLAMA_13B = ModelShape("LLaMA-13B", num_layers=40, hidden_size=5120, num_heads=40,
                       num_kv_heads=40, head_dim=128, intermediate_size=13824,
                       vocab_size=32000)
LLAMA3_8B = ModelShape("Llama-3-8B", num_layers=32, hidden_size=4096, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=14336,
                       vocab_size=128256)


@dataclass(frozen=True)
class StepShape:
    """One step as the device runs it.

    query_lens:   new tokens of each scheduled sequence.
    context_lens: each sequence's tokens with KV once the step runs (its query included).
    padded_tokens, logit_rows: the bucket the engine compiles for it
        (jpaged.core.step_shapes.padded_sizes).
    block_size:   tokens per KV block: attention reads whole blocks.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    padded_tokens: int
    logit_rows: int
    block_size: int

    @classmethod
    def of(cls, query_lens: Sequence[int], context_lens: Sequence[int], buckets: BucketSizes,
           block_size: int) -> StepShape:
        """The shape of a step of these sequences in the engine's buckets."""
        num_tokens, num_seqs = sum(query_lens), len(query_lens)
        tokens, _, rows = padded_sizes(num_tokens, num_seqs, buckets, num_tokens == num_seqs)
        return cls(tuple(query_lens), tuple(context_lens), tokens, rows, block_size)

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(query_lens, context_lens) as int64 arrays."""
        return (np.asarray(self.query_lens, np.int64), np.asarray(self.context_lens, np.int64))

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (else the step computes a prompt chunk)."""
        return all(q == 1 for q in self.query_lens)


def linear_flops(model: ModelShape, shape: StepShape) -> float:
    """2 FLOPs per weight per padded token through the layers, and 2 per output-embedding
    weight per logit row (the engine takes logits of the sampled rows only)."""
    return 2.0 * (model.num_layers * model.layer_params * shape.padded_tokens
                  + model.vocab_size * model.hidden_size * shape.logit_rows)


def attended_keys(query_lens, context_lens, window: int | None):
    """Keys the query_len last tokens of a context_len context attend to in all: token
    p sees positions p - window < j <= p (all j <= p without a window). Elementwise
    over numpy arrays of lengths."""
    q, first = query_lens, context_lens - query_lens + 1  # first: keys the first token sees
    if window is None:
        return q * first + q * (q - 1) // 2
    grown = np.clip(window - first + 1, 0, q)  # query tokens that see fewer than window keys
    return grown * first + grown * (grown - 1) // 2 + (q - grown) * window


def attention_flops(model: ModelShape, shape: StepShape) -> float:
    """4 x heads x head_dim FLOPs per (query, key) pair (scores and the weighted sum of
    values), over every layer's pairs."""
    q, c = shape.arrays
    pairs = sum(layers * int(attended_keys(q, c, window).sum())
                for window, layers in model.layers_by_window.items())
    return 4.0 * model.num_heads * model.head_dim * pairs


def blocks_read(query_lens, context_lens, window: int | None, block_size: int):
    """Blocks of a sequence one layer's attention reads: those holding a key some query
    token sees. Elementwise over numpy arrays of lengths."""
    first_key = 0
    if window is not None:
        first_key = np.maximum(0, context_lens - query_lens - window + 1)
    return (context_lens - 1) // block_size - first_key // block_size + 1


def kv_bytes(model: ModelShape, shape: StepShape) -> float:
    """K/V read in whole blocks by every layer, and the step's new K/V written."""
    q, c = shape.arrays
    blocks = sum(layers * int(blocks_read(q, c, window, shape.block_size).sum())
                 for window, layers in model.layers_by_window.items())
    tokens = blocks * shape.block_size + model.num_layers * int(q.sum())
    return float(tokens * model.kv_bytes_per_token_layer)


def allreduce_bytes(model: ModelShape, shape: StepShape, num_chips: int) -> float:
    """Bytes each chip sends in a step's all-reduces: two per layer (after attention and
    after the MLP) of the padded tokens' hidden states, 2 (n - 1) / n of them in a ring."""
    if num_chips == 1:
        return 0.0
    size = shape.padded_tokens * model.hidden_size * model.dtype_bytes
    return 2.0 * model.num_layers * 2 * (num_chips - 1) / num_chips * size


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of a device's peaks in one phase, and a step's fixed cost.

    compute: of peak FLOP/s. bandwidth: of peak memory bytes/s. overhead_s: seconds a
    step costs whatever its shape (the host's scheduling, launches, sampling).
    """

    compute: float
    bandwidth: float
    overhead_s: float

    def as_array(self) -> np.ndarray:
        return np.array([self.compute, self.bandwidth, self.overhead_s])


@dataclass(frozen=True)
class Calibration:
    """A device's efficiency in decode steps and in steps with a prompt chunk; source:
    where the numbers come from (assumed, or fitted to which steps)."""

    decode: Efficiency
    prefill: Efficiency
    source: str

    def as_dict(self) -> dict:
        """JSON-ready; `from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> Calibration:
        return cls(Efficiency(**fields["decode"]), Efficiency(**fields["prefill"]),
                   fields["source"])


ASSUMED = Calibration(
    decode=Efficiency(compute=0.5, bandwidth=0.8, overhead_s=2e-3),
    prefill=Efficiency(compute=0.5, bandwidth=0.8, overhead_s=2e-3),
    source="assumed, not measured: half the peak FLOP/s and 80% of the peak bandwidth "
           "in every part, 2 ms of host and launch overhead per step")


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step of `model` on `device` with `calibration`'s efficiencies."""

    device: Device
    model: ModelShape
    calibration: Calibration = ASSUMED

    def seconds(self, shape: StepShape) -> float:
        eff = self.calibration.decode if shape.is_decode else self.calibration.prefill
        return float(_predict(_terms(self, [shape]), eff.as_array())[0])

    def kv_pool_tokens(self, memory_utilization: float = 0.9) -> int:
        """Tokens of KV the device's memory holds past the weights, at vLLM's default
        share of the memory (activations left out)."""
        free = (self.device.num_chips * self.device.memory_bytes * memory_utilization
                - self.model.weight_bytes)
        if free <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB) "
                             f"leaves no KV memory on {self.device.name}")
        return int(free // (self.model.num_layers * self.model.kv_bytes_per_token_layer))


# Fitting: achieved fractions and overhead from measured step times.

FIT_BOUNDS = (1e-5, 1.0)  # an achieved fraction of a peak
OVERHEAD_BOUNDS = (1e-7, 10.0)


def fit(cost: StepCost, shapes: Sequence[StepShape], seconds: Sequence[float],
        source: str) -> Calibration:
    """The calibration whose model best predicts `seconds` of `shapes` on cost's device and
    model, decode and prefill steps fitted apart; a phase without steps keeps cost's."""
    decode = [i for i, shape in enumerate(shapes) if shape.is_decode]
    prefill = [i for i, shape in enumerate(shapes) if not shape.is_decode]
    fitted = {}
    for phase, rows in (("decode", decode), ("prefill", prefill)):
        fitted[phase] = getattr(cost.calibration, phase)
        if rows:
            fitted[phase] = fit_phase(cost, [shapes[i] for i in rows], [seconds[i] for i in rows])
    return Calibration(fitted["decode"], fitted["prefill"], source)


def fit_phase(cost: StepCost, shapes: Sequence[StepShape], seconds: Sequence[float]
              ) -> Efficiency:
    """One phase's Efficiency: least squares on log(predicted / measured), with a robust
    loss so that a step another process stretched weighs little, from a few starts.

    Every shape must be of one phase (all decode or all with a prompt chunk)."""
    from scipy.optimize import least_squares

    terms = _terms(cost, shapes)
    measured = np.log(np.asarray(seconds, dtype=np.float64))
    lower = np.log([FIT_BOUNDS[0], FIT_BOUNDS[0], OVERHEAD_BOUNDS[0]])
    upper = np.log([FIT_BOUNDS[1], FIT_BOUNDS[1], OVERHEAD_BOUNDS[1]])

    def residuals(log_params: np.ndarray) -> np.ndarray:
        return np.log(_predict(terms, np.exp(log_params))) - measured

    best = None
    for start in _starts(float(np.median(seconds))):
        result = least_squares(residuals, np.log(start), bounds=(lower, upper),
                               loss="soft_l1", f_scale=0.05)
        if best is None or result.cost < best.cost:
            best = result
    compute, bandwidth, overhead = np.exp(best.x)
    return Efficiency(float(compute), float(bandwidth), float(overhead))


def _starts(median_s: float) -> list[np.ndarray]:
    return [np.array([c, b, median_s * o]) for c in (0.05, 0.5) for b in (0.05, 0.5)
            for o in (0.01, 0.3)]


def _terms(cost: StepCost, shapes: Sequence[StepShape]) -> np.ndarray:
    """[steps, 5]: each step's seconds at full efficiency: linear compute and weight
    reads, attention compute and KV reads, and its all-reduce seconds."""
    device, model = cost.device, cost.model
    compute = device.num_chips * device.peak_flops
    memory = device.num_chips * device.peak_bandwidth
    rows = []
    for shape in shapes:
        allreduce = 0.0
        if device.num_chips > 1:
            allreduce = (allreduce_bytes(model, shape, device.num_chips)
                         / device.interconnect_bandwidth)
        rows.append([linear_flops(model, shape) / compute, model.weight_bytes / memory,
                     attention_flops(model, shape) / compute, kv_bytes(model, shape) / memory,
                     allreduce])
    return np.asarray(rows)


def _predict(terms: np.ndarray, params: np.ndarray) -> np.ndarray:
    compute, bandwidth, overhead = params
    return (overhead
            + np.maximum(terms[:, 0] / compute, terms[:, 1] / bandwidth)
            + np.maximum(terms[:, 2] / compute, terms[:, 3] / bandwidth)
            + terms[:, 4])


def relative_errors(cost: StepCost, shapes: Sequence[StepShape], seconds: Sequence[float]
                    ) -> np.ndarray:
    """|predicted - measured| / measured of each step."""
    predicted = np.array([cost.seconds(shape) for shape in shapes])
    measured = np.asarray(seconds, dtype=np.float64)
    return np.abs(predicted - measured) / measured


def error_summary(errors: np.ndarray) -> dict[str, float | int]:
    """Median and 90th percentile of relative errors, in %, and how many steps."""
    if errors.size == 0:
        return {"num_steps": 0, "median_pct": math.nan, "p90_pct": math.nan}
    return {"num_steps": int(errors.size), "median_pct": float(100 * np.median(errors)),
            "p90_pct": float(100 * np.percentile(errors, 90))}
