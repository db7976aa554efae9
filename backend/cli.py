"""The `kvscope` command line. Bad input ends with exit status 2 and one line on stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import ValidationError


class UserError(Exception):
    """An error the user can act on: printed as one line, exit status 2."""


def pydantic_message(e: ValidationError, prefix: str = "") -> str:
    """First validation error as 'field.path: reason'."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{prefix}{loc}: {err['msg']}" if loc else f"{prefix}{err['msg']}"


# ---- kvscope generate ---------------------------------------------------------------------------

SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "seed": "--seed", "n": "--n", "beam_width": "--beam-width",
                  "length_penalty": "--length-penalty"}
ENGINE_FLAGS = {"engine.speculative": "--speculative", "engine.speculative.draft_model": "--speculative",
                "engine.weight_quant": "--weight-quant", "engine.quant_group_size": "--weight-quant",
                "engine.kv_cache_dtype": "--kv-cache-dtype", "sampling.n": "--n", "sampling.beam_width": "--beam-width"}


def cmd_generate(args: argparse.Namespace) -> None:
    from backend.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.engine.request import RequestError
    from backend.engine.sampling_params import SamplingParams
    from backend.model.loader import load_model

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, seed=args.seed, n=args.n, beam_width=args.beam_width,
                                length_penalty=args.length_penalty)
    except ValidationError as e:
        field = e.errors()[0]["loc"][0]
        raise UserError(f"{SAMPLING_FLAGS.get(str(field), field)}: {e.errors()[0]['msg']}") from None
    speculative = None if args.speculative == "off" else {"method": args.speculative, "num_tokens": args.num_draft_tokens}
    loaded = load_model(args.model)
    context = loaded.config.max_position_embeddings
    try:
        config = EngineConfig(max_model_len=context, num_blocks=None, events="off", speculative=speculative,
                              weight_quant=args.weight_quant, kv_cache_dtype=args.kv_cache_dtype)
        engine = Engine(loaded, config)
        req = engine.add_request("cli", args.prompt, args.max_tokens, params)
    except ValidationError as e:
        raise UserError(f"--num-draft-tokens: {e.errors()[0]['msg']}") from None
    except RequestError as e:
        flag = {"prompt": "--prompt", "max_tokens": "--max-tokens", **ENGINE_FLAGS}.get(e.field, e.field)
        raise UserError(f"{flag}: {e.reason}") from None
    while engine.has_unfinished():
        engine.step()
    if not req.multi:
        print(req.output_text)
        return
    for i, out in enumerate(req.outputs):  # n samples in order, or the best beams first
        score = f", score {out['score']:.3f}" if out["score"] is not None else ""
        print(f"--- {i + 1} (log-prob {out['cumulative_logprob']:.2f}{score}, {out['finish_reason']})")
        print(out["output_text"])


# ---- kvscope serve / replay -----------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> None:
    """The API on --port and, unless --no-ui, the dashboard on --ui-port (replay: opened on the trace)."""
    from backend.events.trace import read_trace
    from backend.server.app import create_app, new_token
    from backend.server.manager import RunManager
    from backend.server.serve import is_loopback, serve_forever

    manager = RunManager(default_model=args.model)
    run_id = None
    if getattr(args, "trace", None):
        events = read_trace(args.trace)
        run_id = manager.start_replay(events, paused=True).run_id
        print(f"replaying {args.trace} as run {run_id} ({len(events)} events)")
    token = None if is_loopback(args.host) else new_token()
    app = create_app(manager, token=token, max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origin or None)
    print(f"kvscope API on http://{args.host}:{args.port} (OpenAPI at /schema/openapi.json)")
    if token:
        print(f"changing runs needs the header  Authorization: Bearer {token}")
    if args.no_ui:
        serve_forever(app, args.host, args.port)
        return
    _serve_with_dashboard(app, args, token, run_id)


def _serve_with_dashboard(app, args: argparse.Namespace, token: str | None, run_id: str | None) -> None:
    """The API on a thread, the dashboard (NiceGUI, which wants the main thread) in the foreground."""
    import contextlib
    import socket

    from backend.server.serve import serve_in_thread

    with socket.socket() as probe:  # fail with a clear line before starting anything
        try:
            probe.bind((args.host, args.ui_port))
        except OSError as e:
            raise UserError(f"--ui-port {args.ui_port}: cannot listen there ({e.strerror}); pick another port") from None
    from frontend.app import page_url, run_dashboard

    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(serve_in_thread(app, args.host, args.port))
        except RuntimeError:
            raise UserError(f"--port {args.port}: the API could not start there (port in use?)") from None
        print(f"kvscope dashboard on http://{local}:{args.ui_port}{page_url(run_id)}", flush=True)
        if token:
            print("  (anyone who can open the dashboard can start and control runs through it)")
        model = args.model if args.model != "demo" else None
        run_dashboard(f"http://{local}:{args.port}", args.host, args.ui_port, token=token, default_model=model)


# ---- kvscope train ------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> None:
    from backend.model.train import PRESETS, train_model
    from backend.model.model_card import write_model_card

    names = list(PRESETS) if args.model == "all" else [args.model]
    for name in names:
        metrics = train_model(name, steps=args.steps, threads=args.threads)
        write_model_card(name)
        print(f"{name}: {metrics['val_bits_per_char']} bits/char, {metrics['train_seconds']} s")


# ---- kvscope run -------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> None:
    import json

    from backend.events.bus import EventBus
    from backend.events.trace import TraceWriter
    from backend.run import ScenarioRun
    from backend.scenario import load_scenario
    from backend.report import print_summary, progress_bar

    scenario = load_scenario(args.scenario, args.set or [])
    bus = EventBus(level=scenario.engine.events)
    writer = TraceWriter(args.trace) if args.trace else None
    if writer:
        bus.subscribe(writer)  # before the run exists: its header is the trace's first line
    run = ScenarioRun(scenario, bus)
    try:
        with progress_bar(run.total) as advance:
            summary = run.run(on_step=lambda r: advance(r.num_finished))
    finally:
        if writer:
            writer.close()
    print_summary(summary)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=2)


# ---- kvscope export ----------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> None:
    from pathlib import Path

    from backend.events.trace import read_trace
    from frontend.export import ExportError, check_options, render

    out = Path(args.out)
    try:
        check_options(args.view, out, args.x, args.stride)  # before reading what may be a long trace
        if not Path(args.trace).is_file():
            raise ExportError("trace", "no such trace file")
        render(read_trace(args.trace), args.view, out, x=args.x, step=args.step, stride=args.stride)
    except ExportError as e:
        where = {"trace": args.trace, "view": f"--view {args.view}", "out": f"--out {args.out}",
                 "x": f"--x {args.x}", "step": f"--step {args.step}", "stride": f"--stride {args.stride}"}[e.field]
        raise UserError(f"{where}: {e.reason}") from None
    what = {".json": "Perfetto trace of the timeline", ".gif": "block pool and timeline, animated"}
    print(f"wrote {out} ({what.get(out.suffix.lower(), args.view)})")


def cmd_schema(args: argparse.Namespace) -> None:
    import json

    if args.what == "events":
        from backend.events.schema import json_schema

        schema = json_schema()
    else:
        from backend.scenario import Scenario

        schema = Scenario.model_json_schema()
    print(json.dumps(schema, indent=2))


# ---- wiring ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description="A watchable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="print a completion of a prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--model", default="demo", help="a shipped model name or a model folder")
    g.add_argument("--n", type=int, default=1, help="samples sharing the prompt's blocks")
    g.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0: sample)")
    g.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score = logprob / len ** this")
    g.add_argument("--speculative", choices=("off", "draft", "ngram"), default="off",
                   help="speculative decoding with the demo-draft model or n-gram lookup")
    g.add_argument("--num-draft-tokens", type=int, default=4, help="speculative: tokens drafted per step")
    g.add_argument("--weight-quant", choices=("none", "int8", "int4"), default="none")
    g.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    g.set_defaults(func=cmd_generate)

    for name, helptext in (("serve", "start the backend (and the dashboard)"),
                           ("replay", "serve a recorded trace for replay, no model needed")):
        v = sub.add_parser(name, help=helptext)
        if name == "replay":
            v.add_argument("trace", help="a trace .jsonl file")
        v.add_argument("--host", default="127.0.0.1", help="non-loopback hosts require a bearer token")
        v.add_argument("--port", type=int, default=8000)
        v.add_argument("--ui-port", type=int, default=8080)
        v.add_argument("--no-ui", action="store_true", help="the API only, no dashboard")
        v.add_argument("--model", default="demo", help="model of the OpenAI-compatible API")
        v.add_argument("--cors-origin", action="append", help="allow this browser origin (CORS is off by default)")
        v.add_argument("--max-body-bytes", type=int, default=2_000_000, help="larger request bodies get 413")
        v.set_defaults(func=cmd_serve)

    r = sub.add_parser("run", help="run a scenario headless and print its metrics")
    r.add_argument("scenario", help="a scenario file, or the name of one in scenarios/")
    r.add_argument("--trace", help="write every event to this JSONL file")
    r.add_argument("--report", help="write the summary to this JSON file")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field, e.g. engine.block_size=8 (value parsed as YAML)")
    r.set_defaults(func=cmd_run)

    e = sub.add_parser("export", help="draw a view of a trace as PNG/SVG, or the timeline as a Perfetto trace")
    e.add_argument("trace", help="a trace .jsonl file")
    e.add_argument("--out", required=True,
                   help="FILE.png, FILE.svg, FILE.json (Chrome/Perfetto trace) or FILE.gif (block pool + timeline)")
    e.add_argument("--view", default="timeline", help="timeline, blocks or batch (default timeline)")
    e.add_argument("--x", default="steps", help="timeline x axis: steps or seconds")
    e.add_argument("--step", type=int, default=None,
                   help="the run as of this iteration (default: the end; blocks: the busiest iteration)")
    e.add_argument("--stride", type=int, default=1, help="GIF: a frame every N iterations (default 1)")
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("schema", help="print a JSON Schema")
    s.add_argument("what", choices=["events", "scenario"])
    s.set_defaults(func=cmd_schema)

    t = sub.add_parser("train", help="train the demo models on Tiny Shakespeare (resumable)")
    t.add_argument("--model", default="all", help="demo, demo-draft, demo-mha, demo-mqa, demo-mla or all")
    t.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    t.set_defaults(func=cmd_train)
    return parser


def run_command(func: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """Run a subcommand; user-facing errors become one line on stderr and exit status 2."""
    from backend.engine.request import RequestError
    from backend.events.trace import TraceError
    from backend.model.loader import ModelLoadError
    from backend.scenario import ScenarioError

    try:
        func(args)
    except (UserError, ModelLoadError, ScenarioError, RequestError, TraceError, OSError) as e:
        print(f"kvscope {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
