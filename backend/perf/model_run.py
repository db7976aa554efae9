"""A recorded run on other hardware: every iteration's batch costed by the roofline model.

Any run can be modelled from its events: the header says which model ran (its sizes) and how it
was stored (dtype, weight quantization, KV cache dtype), each `iteration` event says what the batch
held. The model's sizes come, in this order, from a named shape (a simulated run's model), the
header's `model.config` (the whole ModelConfig), for traces without it the config.json of a shipped
model or a model folder on this machine, or, failing all, the header's other fields (hidden =
heads × head_dim, the MLP size solved from the weights' bytes): then the result says it is estimated. The dashboard's modelled time axis, roofline chart and modelled
TTFT / TPOT / throughput all come from here (docs/dashboard.md).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from kvscope.backend.config import DTYPE_BYTES, ModelConfig
from kvscope.backend.errors import ModelLoadError, validation_error
from kvscope.backend.model.packages import SHIPPED_MODELS, SHIPPED_MODELS_DIR, SMOLLM2, read_config
from kvscope.backend.perf.cost_model import BatchItem, Deployment, iteration_cost
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.hardware import HardwareProfile, get_hardware
from kvscope.backend.perf.shapes import SHAPES, ModelShape, shape_from_config
from kvscope.backend.phase import RECOMPUTE, shown_phase

ALIASES = {SMOLLM2: "smollm2-135m"}  # model names whose shape is a named one


@dataclass(frozen=True)
class RunShape:
    shape: ModelShape
    source: str  # where the sizes came from, for the page to say


@dataclass(frozen=True)
class ModelledStep:
    """One iteration as the cost model prices it on the chosen hardware, or as it ran on this machine.

    Its time is the roofs' time plus a fixed cost: the step's dispatch, launches and Python, which no
    byte or FLOP explains. Priced, the fixed cost is the profile's overhead (assumed for a GPU: one
    CUDA-graph replay); `measured`, it is what the engine's clock took beyond the roofs of this machine.
    """

    step: int
    phase: str  # the phase of most of its query tokens: prefill, decode, verify or recompute
    time_s: float
    flops: float
    bytes: float
    bound: str  # memory or compute: which roof the iteration as a whole sits under
    roof_s: float = 0.0  # the time the roofs allow: each op group at its roof (and the all-reduces)
    compute_s: float = 0.0  # every FLOP at the compute roof
    memory_s: float = 0.0  # every byte at the bandwidth roof
    measured: bool = False  # time_s is the engine's clock on this machine, not the model's

    @property
    def fixed_s(self) -> float:
        """The third limit: what the step cost beyond its roofs (dispatch, launches, Python)."""
        return max(0.0, self.time_s - self.roof_s)

    @property
    def limit(self) -> str:
        """What held the step back most: its fixed cost, or the roof it sits under."""
        return "fixed cost" if self.fixed_s > self.roof_s else self.bound

    @property
    def intensity(self) -> float:
        """FLOP per byte of memory traffic."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def attained_flops(self) -> float:
        """FLOP/s reached over the whole iteration, overhead and all-reduces included."""
        return self.flops / self.time_s


@dataclass(frozen=True)
class RequestSteps:
    """When a request arrived, produced its first token and finished, and how many tokens it output."""

    arrival_step: int
    first_token_step: int | None
    finish_step: int | None
    num_output_tokens: int


@dataclass(frozen=True)
class ModelledLatency:
    ttft_s: float | None  # mean over the requests with a first token
    tpot_s: float | None  # mean over the finished requests with more than one token
    tokens_per_s: float | None  # output tokens over the modelled seconds of every iteration


# ---- the model's shape ----------------------------------------------------------------------------

def run_shape(model: dict, weights: dict | None = None) -> RunShape:
    """The sizes of the header's model (its `model` and `weights` parts), in the run's dtype."""
    name, dtype = str(model.get("name", "")), model.get("dtype", "float32")
    if dtype not in DTYPE_BYTES:
        raise PerfError("model.dtype", f"{dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    named = ALIASES.get(name, name)
    if named in SHAPES:
        shape, source = SHAPES[named], f"the named shape {named}"
    elif model.get("config"):
        shape, source = shape_from_config(ModelConfig.model_validate(model["config"]), name), "the trace header"
    elif (config := folder_config(name)) is not None:
        shape, source = shape_from_config(config, name), f"{Path(name).name}'s config.json"
    else:
        shape, source = shape_from_config(estimated_config(model, weights), name), "estimated from the trace header"
    config = shape.config.model_copy(update={"torch_dtype": dtype})
    return RunShape(ModelShape(shape.name, config, shape.moe, shape.note), source)


def folder_config(name: str) -> ModelConfig | None:
    """The config.json of a shipped model or a model folder on this machine; None when there is none."""
    if not name:
        return None  # Path("") is the working directory, not the run's model
    folder = SHIPPED_MODELS_DIR / name if name in SHIPPED_MODELS else Path(name)
    try:
        return read_config(folder) if (folder / "config.json").is_file() else None
    except (ModelLoadError, OSError):
        return None  # a folder that is not a model: fall back to the header


def estimated_config(model: dict, weights: dict | None) -> ModelConfig:
    """Sizes the header lacks, from what it has: hidden = heads × head_dim, the MLP from the weights' bytes.

    Assumes a Llama-style layer (q/k/v/o, SwiGLU) and tied embeddings, as every shipped model has.
    """
    if model.get("attention") == "mla":
        raise PerfError("model", "an MLA model's latent sizes are not in the trace header; "
                                 "model it on a machine that has its folder")
    try:
        layers, heads, kv_heads, head_dim, vocab = (int(model[k]) for k in
                                                    ("n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size"))
    except (KeyError, TypeError, ValueError) as e:
        raise PerfError("model", f"the trace header lacks a model size ({e})") from None
    hidden = heads * head_dim
    unquantized = (weights or {}).get("bytes_unquantized")
    if not unquantized:
        raise PerfError("model", "the trace header has no weight bytes to size the MLP from")
    params = unquantized / DTYPE_BYTES[model.get("dtype", "float32")]
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_layer_mlp = (params - vocab * hidden - layers * attention) / layers
    intermediate = round(per_layer_mlp / (3 * hidden))
    if intermediate < 1:
        raise PerfError("model", "the trace header's weight bytes leave no room for an MLP")
    try:
        return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, tie_word_embeddings=True)
    except ValidationError as e:
        raise validation_error(e, "model", PerfError) from None  # e.g. heads that KV heads do not divide


def run_deployment(header: dict, hardware: str | HardwareProfile, tp: int = 1) -> tuple[Deployment, RunShape]:
    """The run's model, stored as it ran (weight quantization, KV dtype), on `hardware` over `tp` GPUs."""
    shaped = run_shape(header.get("model") or {}, header.get("weights"))
    config = header.get("config") or {}
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    weights = header.get("weights") or {}  # what ran: a GGUF file's own quantization, or weight_quant's
    quant = weights.get("quant") or config.get("weight_quant", "none")
    group = weights.get("group_size") or (0 if weights.get("gguf") else config.get("quant_group_size", 64))
    lm_head = layer_quant(weights["lm_head"]) if weights.get("lm_head") else None
    dep = Deployment(shaped.shape, hw, tp, config.get("kv_cache_dtype", "auto"), quant, group, lm_head)
    return dep, shaped


def layer_quant(kind: str) -> tuple[str, int]:
    """A header's layer kind as the cost model's (quant, group size): "int4 g32" -> ("int4", 32), "int8 per row"
    -> ("int8", 0) (one scale per row prices as one per tensor: the scales are a rounding error), "float32" ->
    ("none", 0)."""
    mode, _, grouping = kind.partition(" ")
    return (mode, int(grouping[1:]) if grouping.startswith("g") else 0) if mode in ("int8", "int4") else ("none", 0)


# ---- iterations -----------------------------------------------------------------------------------

def batch_item(phase: str, num_query_tokens: int, context_len: int) -> BatchItem:
    """One batch row; a decode row of more than one token is a recompute (no KV cache): a prefill that samples once."""
    if phase in ("decode", RECOMPUTE) and num_query_tokens > 1:
        return BatchItem("prefill", num_query_tokens, context_len)
    return BatchItem("decode" if phase == RECOMPUTE else phase, num_query_tokens, context_len)


def model_step(dep: Deployment, step: int, rows: Sequence[tuple[str, int, int]]) -> ModelledStep:
    """An iteration of (phase, num_query_tokens, context_len) rows priced on the deployment."""
    cost = iteration_cost(dep, [batch_item(*row) for row in rows])
    tokens: dict[str, int] = {}
    for phase, q, _ in rows:
        tokens[phase] = tokens.get(phase, 0) + q
    return ModelledStep(step, max(tokens, key=tokens.__getitem__), cost.time_s, cost.flops, cost.bytes, cost.bound,
                        cost.roof_s, cost.compute_s, cost.memory_s)


def as_measured(priced: ModelledStep, measured_s: float) -> ModelledStep:
    """The step at the time the engine measured for it, against this machine's roofs: its fixed cost is the rest."""
    return replace(priced, time_s=measured_s, measured=True)


def median_fixed_s(steps: Iterable[ModelledStep], phase: str = "decode") -> float | None:
    """The median fixed cost of a run's `phase` steps (None without one): the figure the views quote."""
    fixed = sorted(s.fixed_s for s in steps if s.phase == phase)
    return statistics.median(fixed) if fixed else None


def event_rows(event: dict, kv_cache: bool = True) -> list[tuple[str, int, int]]:
    """An `iteration` event's batch as rows; without a KV cache a decode row recomputes its context."""
    return [(shown_phase(b["phase"], kv_cache), b["num_query_tokens"], b["context_len"]) for b in event["batch"]]


def modelled_times(header: dict, iterations: Iterable[dict], hardware: str | HardwareProfile,
                   tp: int = 1) -> list[ModelledStep]:
    """Every non-empty iteration event of a run, priced on `hardware` over `tp` GPUs."""
    dep, _ = run_deployment(header, hardware, tp)
    kv_cache = (header.get("config") or {}).get("kv_cache", True) is not False
    return [model_step(dep, e["step"], event_rows(e, kv_cache)) for e in iterations if e["batch"]]


# ---- latencies ------------------------------------------------------------------------------------

def modelled_latency(steps: Sequence[ModelledStep], requests: Iterable[RequestSteps], output_tokens: int,
                     known_from: int = 0) -> ModelledLatency:
    """Mean TTFT and TPOT and the throughput, in modelled seconds (the engine-time rules of RunHistory).

    `steps` are the iterations on record from step `known_from` on (a page that joined mid-run knows
    only the last ones): a latency that began before it is left out, not understated.
    """
    order = sorted(steps, key=lambda s: s.step)
    ends, total = [], 0.0
    for s in order:
        total += s.time_s
        ends.append(total)
    numbers = [s.step for s in order]

    def end_of(step: int) -> float:
        """Modelled seconds up to the end of `step` (an idle step adds nothing)."""
        i = bisect.bisect_right(numbers, step)
        return ends[i - 1] if i else 0.0

    ttfts, tpots = [], []
    for r in requests:
        if r.first_token_step is None or r.arrival_step < known_from:
            continue
        first = end_of(r.first_token_step)
        ttfts.append(first - end_of(r.arrival_step - 1))
        if r.finish_step is not None and r.num_output_tokens > 1:
            tpots.append((end_of(r.finish_step) - first) / (r.num_output_tokens - 1))
    return ModelledLatency(sum(ttfts) / len(ttfts) if ttfts else None, sum(tpots) / len(tpots) if tpots else None,
                           output_tokens / total if total > 0 and output_tokens else None)
