"""Simulate mode: the real scheduler and block manager on a shape-only model, each forward pass priced.

No weights load and no KV tensor is allocated. A `SimulatedRunner` stands where the ModelRunner
stands (the engine's Runtime): each batch is priced by the cost model (`iteration_cost`) and a
modelled clock moves on by that time, so every event's `t`, each iteration's `duration_s`, TTFT and
TPOT are modelled seconds. The logits come from a seeded table over the stand-in tokenizer's ids
(the next token's logits given the last one): tokens are deterministic and cheap, and say nothing
about the model. The stand-in has no EOS, so each request runs to its max_tokens.

The block pool is what one GPU holds after its share of the weights (vLLM's rule): memory x
gpu_memory_utilization - weights, cut into blocks of one rank's share of the KV (the KV heads are
split across tensor-parallel ranks, MLA's latent is not).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvscope.backend.config import MAX_NUM_BLOCKS, EngineConfig, ModelConfig, kv_storage_dtype
from kvscope.backend.engine.engine import Runtime
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_input import StepInput
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR
from kvscope.backend.model.tokenizer import Tokenizer
from kvscope.backend.perf.cost_model import BatchItem, Deployment, IterationCost, iteration_cost, resident_bytes
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.whatif import deployment

STAND_IN_MODEL = "demo"  # its tokenizer turns prompts into ids and names the stand-in tokens
LOGIT_SCALE = 3.0  # spread of the stand-in logits: a few likely tokens per row, as a trained model has
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory for weights plus KV cache


class ModelledClock:
    """Seconds of modelled time: it moves only when the runner prices an iteration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class PoolShape:
    """A KV cache's sizes with no tensors behind them: all that the engine and its header read of one."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype  # the model's
    storage_dtype: torch.dtype  # the cache's (int8 when quantized)
    bytes_per_token: int  # the whole model's (all ranks), as the header's KV formula says

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass
class ShapeOnlyModel:
    """What a run reads of its model, without weights: the shape's config and the stand-in's tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer


class SimulatedRunner:
    """A runner (executor.Forward): logits for a StepInput, the forward priced instead of computed."""

    def __init__(self, dep: Deployment, clock: ModelledClock, vocab_size: int, seed: int) -> None:
        self.dep, self.clock = dep, clock
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, generator=gen) * LOGIT_SCALE  # [V, V]: last -> next
        self.last: IterationCost | None = None

    def logits(self, inp: StepInput) -> torch.Tensor:
        """Advance the clock by the batch's modelled time; one row of stand-in logits per sampling sequence."""
        ends = set(inp.logit_rows)
        self.last = iteration_cost(self.dep, [BatchItem(inp.phases[i], inp.num_query(i), inp.context_lens[i],
                                                        inp.query_starts[i + 1] - 1 in ends)
                                              for i in range(inp.num_rows)])
        self.clock.advance(self.last.time_s)
        vocab = self.table.shape[0]
        return self.table[[inp.input_ids[r] % vocab for r in inp.logit_rows]]

    def iteration_fields(self) -> dict:
        """The last priced iteration's intensity and bound, once (an empty iteration gets none)."""
        cost, self.last = self.last, None
        return {} if cost is None else {"intensity": cost.intensity, "bound": cost.bound}


@cache
def stand_in_tokenizer() -> Tokenizer:
    """The demo model's tokenizer without its EOS (no weights are read)."""
    return Tokenizer.from_file(SHIPPED_MODELS_DIR / STAND_IN_MODEL / "tokenizer.json", eos_token_ids=[])


def check_engine(config: EngineConfig) -> None:
    if config.speculative is not None:
        raise PerfError("engine.speculative", "simulate mode runs no model: there is no draft to propose and "
                                              "no distribution to verify against")
    if config.compile_decode:
        raise PerfError("engine.compile_decode", "simulate mode runs no model: there is no forward to compile "
                                                 "(the cost model prices each step as it is)")
    if config.batch_invariant:
        raise PerfError("engine.batch_invariant", "simulate mode runs no model: it computes no logits whose bits "
                                                  "could depend on the batch")


def simulated_sampling(params: SamplingParams) -> SamplingParams:
    """Drop what only a real model's vocabulary gives meaning to: stop strings and ids, biases, allowed ids,
    grammars (the stand-in has no EOS: a grammar could never end)."""
    return params.model_copy(update={"stop": [], "stop_token_ids": [], "logit_bias": {}, "allowed_token_ids": None,
                                     "structured_outputs": None})


def kv_pool(dep: Deployment, utilization: float) -> tuple[float, float]:
    """(weights, KV pool) bytes of one GPU: the pool is memory x utilization less the weights."""
    weights = resident_bytes(dep)
    pool = dep.hardware.memory_bytes * utilization - weights
    if pool <= 0:
        raise PerfError("simulate", f"{dep.shape.name} needs {weights / 1e9:,.1f} GB of weights per GPU, more than "
                                    f"{utilization:g} of the {dep.hardware.memory_bytes / 1e9:,.0f} GB of "
                                    f"{dep.hardware.name}: raise tp or pick a larger GPU")
    return weights, pool


def simulation(model_shape: str, hardware: str, tp: int, link: str | None, utilization: float,
               config: EngineConfig, seed: int) -> tuple[ShapeOnlyModel, EngineConfig, Runtime]:
    """The shape-only model, the engine config with the GPU's block count, and the simulated runtime."""
    check_engine(config)
    dep = deployment(model_shape, hardware, tp, config.kv_cache_dtype, config.weight_quant, config.quant_group_size,
                     link)
    weights, pool = kv_pool(dep, utilization)
    num_blocks = int(pool // (dep.kv_bytes_per_token * config.block_size))
    if num_blocks < 1:
        raise PerfError("simulate", f"the KV pool ({pool / 1e6:,.1f} MB per GPU) holds no block of "
                                    f"{config.block_size} tokens")
    if num_blocks > MAX_NUM_BLOCKS:  # its trace's pool, which a replay and every picture size themselves from
        raise PerfError("engine.block_size", f"the KV pool ({pool / 1e9:,.1f} GB per GPU) holds {num_blocks:,} blocks of "
                                             f"{config.block_size} tokens, more than the {MAX_NUM_BLOCKS:,} an engine "
                                             "has: raise engine.block_size")
    shape_config = dep.shape.config
    dtype = getattr(torch, dep.dtype)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dep.dtype)
    cache = PoolShape(num_blocks, config.block_size, dtype, getattr(torch, kv_dtype),
                      shape_config.kv_bytes_per_token(kv_dtype))
    tokenizer = stand_in_tokenizer()
    clock = ModelledClock()
    hw = dep.hardware
    info = {"model_shape": dep.shape.name, "hardware": hw.name, "hardware_label": hw.label, "tp": tp,
            "link": hw.link.name if hw.link and tp > 1 else None, "gpu_memory_utilization": utilization,
            "weights_bytes_per_gpu": weights, "kv_pool_bytes_per_gpu": pool,
            "kv_bytes_per_token_per_gpu": dep.kv_bytes_per_token, "peak_flops": hw.peak_flops(dep.dtype),
            "mem_bandwidth": hw.mem_bandwidth, "ridge": hw.ridge(dep.dtype), "stand_in_vocab": tokenizer.vocab_size}
    runner = SimulatedRunner(dep, clock, tokenizer.vocab_size, seed)
    weights_header = {"quant": config.weight_quant, "group_size": config.quant_group_size, "bytes": weights * tp,
                      "bytes_unquantized": resident_bytes(Deployment(dep.shape, hw, tp)) * tp}
    runtime = Runtime(cache, runner, f"simulated {hw.label}" + (f" x{tp}" if tp > 1 else ""), "simulated",
                      weights_header, clock, {"simulated": info}, runner.iteration_fields)
    model = ShapeOnlyModel(dep.shape.name, SHIPPED_MODELS_DIR / STAND_IN_MODEL, shape_config, tokenizer)
    return model, config.model_copy(update={"num_blocks": num_blocks}), runtime
