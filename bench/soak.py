"""Soak benchmark: a server left running, fed one-token requests; does its memory stay put?

    python -m bench.soak [--requests 20000] [--warmup 1000] [--concurrency 4] [--model demo]
                         [--history 256] [--trace-window 20000]

Starts `kvscope serve --no-ui` on a free loopback port in its own process, sends `--requests`
one-token /v1/completions requests (`--concurrency` at a time), and reads the server's resident
memory (/proc/PID/status VmRSS) after the warm-up and at the end. Prints one table: RSS growth after
warm-up (target <= 50 MB), growth per 1,000 requests, and the size of the api run's snapshot
(target <= 1 MB) and of its /trace, which a run that lives forever must keep bounded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.report import command_line, progress, table
from kvscope.backend.server.serve import free_port

ROOT = Path(__file__).resolve().parents[1]
RSS_TARGET_MB = 50
TARGET_REQUESTS = 20_000  # the target is for this many; a shorter soak is projected to it
SNAPSHOT_TARGET_MB = 1.0
START_TIMEOUT_S = 120


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(port: int, args: argparse.Namespace) -> subprocess.Popen:
    return launch(["--port", str(port), "--model", args.model, "--history", str(args.history),
                   "--trace-window", str(args.trace_window), "--max-waiting", str(max(64, 2 * args.concurrency))])


def launch(flags: list[str]) -> subprocess.Popen:
    """`kvscope serve --no-ui FLAGS` in its own process, once it listens."""
    argv = [sys.executable, "-m", "kvscope", "serve", "--no-ui", *flags]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "API on" not in (proc.stdout.readline() or ""):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the server did not start")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # a full pipe would block the server
    return proc


def send(client: httpx.Client, count: int, concurrency: int) -> int:
    """count one-token requests, concurrency at a time; returns how many were answered 200."""
    body = {"prompt": "ROMEO:", "max_tokens": 1, "temperature": 0}

    def one(_: int) -> bool:
        return client.post("/v1/completions", json=body).status_code == 200

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, range(count)))


def soak(args: argparse.Namespace) -> list[list]:
    port = free_port()
    proc = start_server(port, args)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            progress(f"warm-up: {args.warmup} requests")
            ok = send(client, args.warmup, args.concurrency)
            before = rss_mb(proc.pid)
            started = time.monotonic()
            progress(f"soak: {args.requests} requests")
            ok += send(client, args.requests, args.concurrency)
            seconds = time.monotonic() - started
            after = rss_mb(proc.pid)
            snapshot = len(client.get("/api/runs/api").content) / 1024**2
            trace = len(client.get("/api/runs/api/trace").content) / 1024**2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    growth = after - before
    per_k = growth / args.requests * 1000
    projected = max(growth, per_k * TARGET_REQUESTS / 1000)
    return [["requests (after warm-up)", args.requests, ""],
            ["answered 200 (all)", f"{ok} / {args.requests + args.warmup}", ""],
            ["requests per second", f"{args.requests / seconds:.0f}", ""],
            ["RSS after warm-up (MB)", f"{before:.0f}", ""],
            ["RSS at the end (MB)", f"{after:.0f}", ""],
            ["RSS growth (MB)", f"{growth:.1f}", ""],
            ["RSS growth per 1,000 requests (MB)", f"{per_k:.2f}", ""],
            [f"RSS growth over {TARGET_REQUESTS:,} requests (MB)", f"{projected:.0f}",
             _verdict(projected <= RSS_TARGET_MB, f"<= {RSS_TARGET_MB}") +
             ("" if args.requests >= TARGET_REQUESTS else ", projected from this run")],
            ["api snapshot (MB)", f"{snapshot:.2f}",
             _verdict(snapshot <= SNAPSHOT_TARGET_MB, f"<= {SNAPSHOT_TARGET_MB:g}")],
            ["api /trace (MB)", f"{trace:.2f}", f"window of {args.trace_window} events"]]


def _verdict(ok: bool, target: str) -> str:
    return f"{'ok' if ok else 'MISSED'} (target {target})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000, help="one-token requests after the warm-up")
    p.add_argument("--warmup", type=int, default=1_000, help="requests before the first RSS reading")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument("--model", default="demo")
    p.add_argument("--history", type=int, default=256, help="the server's --history")
    p.add_argument("--trace-window", type=int, default=20_000, help="the server's --trace-window")
    args = p.parse_args(argv)
    rows = soak(args)
    print(command_line("bench.soak", argv if argv is not None else sys.argv[1:]))
    print()
    print(table(["measure", "value", "note"], rows))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
