"""What a GPU can tell that this project's CPU cannot, in one run of a few minutes (issue #36, point 5).

    python -m bench.gpu [--quick] [--json OUT.json]

On a machine with CUDA, in order (a failed part is reported and the next one runs):
1. the Triton kernels compiled for the device, against their torch references: tests/test_kernels.py
   and tests/test_weight_matmul.py with TRITON_INTERPRET=0 and KVSCOPE_TEST_DEVICE=cuda, which
   tests/conftest.py makes torch's default device;
2. bench/kernels.py's grid: paged decode attention against torch SDPA and flash_attn's kv-cache kernel
   (when installed), itself without split-K and on an int8 cache, as a share of the memory peak;
3. the weight-only matmuls of kernels/weight_matmul.py (int8 per row, int4 in groups of 64) at 1 and 16
   tokens on Llama-3-8B's layer shapes: time, bytes read and their share of the peak, beside cuBLAS on
   the same weight in bfloat16 (twice int8's bytes, four times int4's);
4. the engine on the Triton backend (the `demo` model in float32, as stored and with int4 weights):
   greedy tokens against the plain reference model (engine/reference.py) on the same device, and its
   decode step at 1 and 32 sequences.
It prints markdown tables for docs/benchmarks.md. CUDA graphs are not captured yet, so part 4 times
the step as kvscope runs it today, launch by launch.

Without CUDA it says so and exits 0. `--interpret-smoke` runs parts 3 and 4 on tiny shapes on the CPU
under TRITON_INTERPRET=1, to check the script itself; its numbers mean nothing.

On a lent device machine (Python 3.12 with torch and triton, no pydantic), the engine's other
dependencies travel as wheels in an ignored folder of the checkout:

    pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .gpu-wheels \\
        pydantic tokenizers safetensors pytest hypothesis
    # device: pip install -q --no-deps .gpu-wheels/*.whl && python -m bench.gpu --json $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

KERNEL_TESTS = ("tests/test_kernels.py", "tests/test_weight_matmul.py")
LLAMA_3_8B = {"q, k, v joined": (6144, 4096), "o_proj": (4096, 4096), "gate, up joined": (28672, 4096),
              "down_proj": (4096, 14336)}  # (out N, in K)
TINY = {"tiny": (64, 128)}
GROUP = 64
PROMPTS = ["ROMEO:\nWhat light", "JULIET:\n", "First Citizen:\nBefore we proceed", "KING HENRY:\nOnce more"]


# ---- 1. the kernels' tests on the device ------------------------------------------------------------


def kernel_tests(quick: bool) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "KVSCOPE_TEST_DEVICE": "cuda"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS,
               *(["-x"] if quick else [])]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"## 1. Triton kernels against their references on the device\n\n`{' '.join(command[1:])}`: {summary}\n")
    if done.returncode:
        print("```\n" + done.stdout[-3000:] + done.stderr[-1000:] + "\n```\n")
    return {"command": " ".join(command[1:]), "summary": summary, "ok": done.returncode == 0}


# ---- 2. paged decode attention ------------------------------------------------------------------------


def attention(quick: bool, device, peak: float | None) -> list[dict]:
    import dataclasses

    import torch

    from bench import kernels

    print("## 2. paged decode attention (bench/kernels.py)\n")
    rows = kernels.run_grid([1, 64] if quick else [1, 16, 64], [4096] if quick else [512, 4096, 32768],
                            device, torch.bfloat16, True, peak)
    kernels.print_table(rows)
    print()
    return [dataclasses.asdict(r) for r in rows]


# ---- 3. the weight-only matmuls ---------------------------------------------------------------------------


def matmuls(shapes: dict, device, cuda: bool, peak: float | None, tokens: tuple[int, ...]) -> list[dict]:
    import torch

    from bench.kernels import time_us
    from kvscope.backend.model.quant import pack_int4, quantize_weight
    from kvscope.kernels.weight_matmul import weight_only_matmul

    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bfloat16 dot is unsound
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device) * 0.02
        codes8, scales8 = quantize_weight(w, "int8", k, dtype)  # one scale per row
        codes4, scales4 = quantize_weight(w, "int4", GROUP, dtype)
        packed4 = pack_int4(codes4)
        dense = w.to(dtype)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            activations = x.nbytes + m * n * 4  # x read, float32 y written
            runs = {"int8 per row": (lambda: weight_only_matmul(x, codes8, scales8, k), codes8.nbytes + scales8.nbytes),
                    f"int4 g{GROUP}": (lambda: weight_only_matmul(x, packed4, scales4, GROUP, int4=True),
                                       packed4.nbytes + scales4.nbytes),
                    f"{str(dtype).removeprefix('torch.')} (torch)": (lambda: x @ dense.T, dense.nbytes)}
            for kind, (fn, weight_bytes) in runs.items():
                us = time_us(fn, cuda)
                gbps = (weight_bytes + activations) / us / 1e3
                rows.append({"layer": f"{name} [{n} x {k}]", "tokens": m, "kind": kind, "us": us, "gb_s": gbps,
                             "peak_pct": 100 * gbps / peak if peak else None})
    return rows


def print_matmuls(rows: list[dict]) -> None:
    from bench.report import table

    print("## 3. weight-only matmuls (kernels/weight_matmul.py) against their bytes\n")
    print(table(["layer [N x K]", "tokens", "weights", "µs", "GB/s", "% of peak"],
                [[r["layer"], str(r["tokens"]), r["kind"], f"{r['us']:.1f}", f"{r['gb_s']:.0f}",
                  "—" if r["peak_pct"] is None else f"{r['peak_pct']:.0f}%"] for r in rows]))
    print()


# ---- 4. the engine ----------------------------------------------------------------------------------------


def engine(device: str, quick: bool) -> list[dict]:
    import torch

    from kvscope.backend.config import EngineConfig
    from kvscope.backend.engine.engine import Engine
    from kvscope.backend.engine.reference import reference_generate
    from kvscope.backend.engine.sampling_params import SamplingParams
    from kvscope.backend.model.loader import load_model

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    tokens = 3 if quick else 32
    rows = []
    for quant in ("none", "int4"):
        loaded = load_model("demo")
        config = EngineConfig(device=device, attention_backend="triton", weight_quant=quant, quant_group_size=GROUP,
                              num_blocks=64 if quick else 1024, max_num_seqs=32, events="off")
        eng = Engine(loaded, config)
        prompts = PROMPTS[:1] if quick else PROMPTS
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, tokens, greedy)
        while eng.has_unfinished():
            eng.step()
        model = eng.executor.runner.model  # the engine's own weights, as it ran them
        equal = sum(r.seq.output_token_ids == reference_generate(model, r.prompt_ids, tokens, greedy)
                    for r in (eng.requests[str(i)] for i in range(len(prompts))))
        row = {"weights": quant, "greedy_equal": f"{equal}/{len(prompts)}"}
        for batch in ((1,) if quick else (1, 32)):
            row[f"step_ms_{batch}"] = decode_step_ms(eng, batch, 1 if quick else 32, greedy, device)
        rows.append(row)
        del eng
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_step_ms(eng, batch: int, steps: int, greedy, device: str) -> float:
    """The median decode step of `batch` sequences, after their prompts and a first few tokens."""
    import statistics

    import torch

    for i in range(batch):
        eng.add_request(f"time-{batch}-{i}", "ROMEO:\n", steps + 4, greedy)
    for _ in range(2):
        eng.step()  # the prompts, the first token
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    while eng.has_unfinished():
        eng.step()
    return 1000 * statistics.median(times)


def print_engine(rows: list[dict]) -> None:
    from bench.report import table

    print("## 4. the engine on the Triton backend (demo model, float32 activations)\n")
    print(table(["weights", "greedy tokens equal to the reference", "decode step, 1 sequence", "32 sequences"],
                [[r["weights"], r["greedy_equal"], f"{r['step_ms_1']:.2f} ms",
                  f"{r['step_ms_32']:.2f} ms" if "step_ms_32" in r else "—"] for r in rows]))
    print()


# ---- the run ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and steps (about a minute)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--interpret-smoke", action="store_true", help="parts 3 and 4, tiny, on the CPU interpreter")
    args = p.parse_args(argv)
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    from bench.kernels import peak_for, write_json

    cuda = torch.cuda.is_available() and not args.interpret_smoke
    meta = {"command": "python -m bench.gpu " + " ".join(argv), "torch": torch.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    if not cuda and not args.interpret_smoke:
        print("bench.gpu: no CUDA device here; these figures need a GPU. Nothing measured.")
        return 0
    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    peak = peak_for(name) if cuda else None
    meta |= {"device": name, "peak_gbps": peak}
    print(f"# bench.gpu on {name} (memory peak {peak or '?'} GB/s), torch {torch.__version__}, {meta['date']}\n")
    results: dict = {"meta": meta}
    device = "cuda" if cuda else "cpu"
    parts = [("matmuls", lambda: matmuls(TINY if not cuda else LLAMA_3_8B, device, cuda, peak,
                                         (1,) if not cuda else (1, 16))),
             ("engine", lambda: engine(device, args.quick or not cuda))]
    if cuda:
        parts = [("kernel_tests", lambda: kernel_tests(args.quick)),
                 ("attention", lambda: attention(args.quick, device, peak)), *parts]
    printers = {"matmuls": print_matmuls, "engine": print_engine}
    for key, run in parts:
        try:
            results[key] = run()
            if key in printers:
                printers[key](results[key])
        except Exception as e:  # noqa: BLE001 - one part's failure is a finding, and the next part still runs
            results[key] = {"error": f"{type(e).__name__}: {e}"}
            print(f"## {key}: failed, {type(e).__name__}: {e}\n")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
