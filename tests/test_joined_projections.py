"""Q, K, V and gate, up joined into one matmul each (backend/model/joined.py): the same logits as the
parts one by one, no byte stored twice, the checkpoint's names kept, and never a stale joined layer."""

import copy
import subprocess
import sys

import pytest
import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request import RequestError
from kvscope.backend.model.joined import join, join_projections
from kvscope.backend.model.loader import load_model
from kvscope.backend.model.quant import QuantLinear, quantize_model, weight_bytes
from kvscope.backend.model.sharding import shard_model, shard_plan
from tests.conftest import make_tiny_model

IDS = torch.tensor([[5, 17, 300, 42, 7, 99, 1000, 3]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    from kvscope.backend.model.attention import DenseCausalBackend

    with torch.no_grad():
        return model.logits(model(IDS, torch.arange(IDS.shape[1])[None], DenseCausalBackend()))


def groups(model: torch.nn.Module) -> list:
    return [(m, m.joined) for m in model.modules() if hasattr(m, "joined")]


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_joined_layers_give_the_parts_logits_from_the_same_bytes(quant):
    loaded = load_model("demo")  # its own copy: the session's demo model is joined by every engine built on it
    model = quantize_model(loaded.model, quant, 32) if quant != "none" else loaded.model
    parts = copy.deepcopy(model)
    names, nbytes = {k: v.shape for k, v in model.state_dict().items()}, weight_bytes(model)
    assert join_projections(model) == 6 * 2  # six layers, each an attention and an MLP
    assert {k: v.shape for k, v in model.state_dict().items()} == names, "the checkpoint's names and shapes stay"
    assert weight_bytes(model) == nbytes, "the parts view the joined buffer: nothing is stored twice"
    torch.testing.assert_close(logits(model), logits(parts), rtol=0, atol=2e-5 if quant == "none" else 1e-2)
    assert torch.equal(logits(model).argmax(-1), logits(parts).argmax(-1))
    assert join_projections(model) == 12 and all(j is not None and j.holds(_parts(m)) for m, j in groups(model))


def test_a_copy_that_replaced_the_parts_never_runs_the_old_joined_layer():
    loaded = make_tiny_model(n_kv_heads=2)
    model = copy.deepcopy(loaded.model)
    join_projections(model)
    quantized = quantize_model(model, "int4", 32)  # deep-copies the joined float layers along with the model
    fresh = quantize_model(copy.deepcopy(loaded.model), "int4", 32)
    assert all(not j.holds(_parts(m)) for m, j in groups(quantized)), "stale joined layers must not hold"
    assert torch.equal(logits(quantized), logits(fresh)), "the quantized parts run, not the float joined copy"
    shard = shard_model(model, shard_plan(model.config, 1, 2))  # a rank's shard cuts the parts anew
    assert all(j is None or not j.holds(_parts(m)) for m, j in groups(shard))


def test_an_engine_joins_its_model_and_compile_decode_is_refused_where_it_cannot_run():
    loaded = make_tiny_model(n_kv_heads=2)
    Engine(loaded, EngineConfig(num_blocks=16))
    assert all(j is not None and j.holds(_parts(m)) for m, j in groups(loaded.model))
    for kv in ("auto", "int8"):  # compiled as the engine starts, on block 0, which it puts back
        engine = Engine(loaded, EngineConfig(num_blocks=16, compile_decode=True, kv_cache_dtype=kv))
        assert engine.runtime.compile_s > 0 and not engine.cache.data.any()
        assert engine.cache.scales is None or not engine.cache.scales.any()
    for bad in (dict(attention_backend="triton"), dict(tensor_parallel=2)):
        with pytest.raises(RequestError) as e:
            Engine(loaded, EngineConfig(num_blocks=16, compile_decode=True, **bad))
        assert e.value.field in ("engine.compile_decode", "engine.attention_backend")


def test_int4_parts_that_are_not_whole_packing_blocks_stay_apart():
    """torch packs int4 rows in blocks whose size depends on the CPU (32 or 64): 48 and 16 rows are whole
    blocks on none, and a joined packing would not equal the parts' (asked of the kernel itself)."""
    layers = [QuantLinear.from_linear(torch.nn.Linear(64, n), "int4", 32) for n in (48, 16, 16)]
    assert all(layer.kernel == "int4pack" for layer in layers)
    assert join(tuple(layers)) is None


def test_importing_the_engine_imports_no_compiler_and_no_triton():
    """torch.compile imports triton, and triton read before TRITON_INTERPRET is set runs no interpreted
    kernel ("Cannot call @triton.jit'd outside of the scope of a kernel"): the compiled decode is made on
    first use, never at import."""
    code = ("import sys, kvscope.backend.engine.engine, kvscope.backend.engine.runner, kvscope.cli; "
            "print(sorted(m for m in ('triton', 'torch._inductor') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def _parts(module: torch.nn.Module) -> tuple:
    if hasattr(module, "v_proj"):
        return module.q_proj, module.k_proj, module.v_proj
    return module.gate_proj, module.up_proj
