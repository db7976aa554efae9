"""Viewers benchmark: does watching the api run slow the OpenAI API down?

    python -m bench.viewers [--viewers 200] [--seconds 15] [--concurrency 4] [--slow-ms 0] [--model demo]

Starts `kvscope serve --no-ui` on a free loopback port in its own process and measures /v1
throughput (one-token completions, `--concurrency` at a time) for `--seconds`: first with no
viewer, then with `--viewers` websocket viewers of the api run (each reading everything, or
sleeping `--slow-ms` per message to play a slow client), which run in a process of their own so
that reading them does not slow the load generator down. Prints one table; the target is a
throughput with viewers of at least 70% of the one without.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from bench.report import command_line, progress, table
from bench.soak import launch
from kvscope.backend.server.serve import free_port

TARGET = 0.70


def start_server(port: int, viewers: int, model: str):
    return launch(["--port", str(port), "--model", model, "--max-viewers", str(max(viewers, 1))])


async def load(base: str, seconds: float, concurrency: int) -> int:
    """One-token completions, concurrency at a time, for `seconds`; returns how many got a 200."""
    body = {"prompt": "ROMEO:", "max_tokens": 1, "temperature": 0}
    deadline = time.monotonic() + seconds
    done = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            done += (await client.post("/v1/completions", json=body)).status_code == 200

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return done


async def viewer(url: str, slow_s: float, counts: list[int], stop: asyncio.Event) -> None:
    """One websocket viewer of the api run: reads (slowly, if asked) until told to stop."""
    try:
        async with connect(url, max_size=None, compression=None) as ws:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(ws.recv(), timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                counts[0] += 1
                if slow_s:
                    await asyncio.sleep(slow_s)
    except (OSError, WebSocketException):
        counts[1] += 1  # refused or dropped


async def watch(url: str, viewers: int, slow_s: float, seconds: float) -> list[int]:
    """`viewers` viewers for `seconds`; returns [messages read, viewers refused or dropped]."""
    counts, stop = [0, 0], asyncio.Event()
    tasks = [asyncio.create_task(viewer(url, slow_s, counts, stop)) for _ in range(viewers)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    return counts


def watch_in_process(url: str, viewers: int, slow_s: float, seconds: float, out) -> None:
    out.send(asyncio.run(watch(url, viewers, slow_s, seconds)))


async def measure(base: str, args: argparse.Namespace, viewers: int) -> tuple[int, int, int]:
    """(requests answered, messages the viewers read, viewers refused or dropped)."""
    if not viewers:
        return await load(base, args.seconds, args.concurrency), 0, 0
    url = base.replace("http://", "ws://") + "/ws/runs/api"
    ours, theirs = multiprocessing.Pipe()
    lead_s = 2.0  # every viewer connected and past its first snapshot before the load starts
    watcher = multiprocessing.get_context("spawn").Process(
        target=watch_in_process, args=(url, viewers, args.slow_ms / 1000, lead_s + args.seconds, theirs))
    watcher.start()
    await asyncio.sleep(lead_s)
    answered = await load(base, args.seconds, args.concurrency)
    messages, refused = await asyncio.to_thread(ours.recv)
    watcher.join()
    return answered, messages, refused


async def run(args: argparse.Namespace) -> list[list]:
    port = free_port()
    proc = start_server(port, args.viewers, args.model)
    base = f"http://127.0.0.1:{port}"
    try:
        await load(base, 2.0, args.concurrency)  # warm-up: the api run exists, the model is warm
        progress(f"{args.seconds:g} s without viewers")
        alone, _, _ = await measure(base, args, 0)
        progress(f"{args.seconds:g} s with {args.viewers} viewers")
        watched, messages, refused = await measure(base, args, args.viewers)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ratio = watched / alone if alone else 0.0
    verdict = f"{'ok' if ratio >= TARGET else 'MISSED'} (target >= {TARGET:.0%})"
    return [["no viewers", alone, f"{alone / args.seconds:.1f}", "", "", ""],
            [f"{args.viewers} viewers" + (f" ({args.slow_ms:g} ms per message)" if args.slow_ms else ""), watched,
             f"{watched / args.seconds:.1f}", f"{messages / (args.seconds + 2):.0f}", refused,
             f"{ratio:.0%} {verdict}"]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.viewers", description=__doc__.splitlines()[0])
    p.add_argument("--viewers", type=int, default=200)
    p.add_argument("--seconds", type=float, default=15.0, help="each measurement's length")
    p.add_argument("--concurrency", type=int, default=4, help="/v1 requests in flight at once")
    p.add_argument("--slow-ms", type=float, default=0.0, help="each viewer sleeps this long per message")
    p.add_argument("--model", default="demo")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    print(command_line("bench.viewers", argv if argv is not None else sys.argv[1:]))
    print()
    print(table(["case", "/v1 requests", "per second", "viewer messages/s", "viewers refused", "vs no viewers"],
                rows))


if __name__ == "__main__":
    main()
