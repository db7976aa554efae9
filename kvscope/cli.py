"""The `kvscope` command line. Bad input ends with exit status 2 and one line on stderr."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

from pydantic import ValidationError

from kvscope.backend.config import KV_CACHE_DTYPES
from kvscope.backend.errors import KvscopeError, validation_error


class UserError(KvscopeError):
    """A bad flag: the flag (with its value) and the reason."""


class Interrupted(Exception):
    """Ctrl-C, with what it stopped: the line `kvscope CMD: ...` that run_command prints before exit 130."""


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line (`kvscope serve: argument --port: ...`): the usage that
    argparse prints first pushed the one line that matters off a small terminal. `--help` has it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# ---- kvscope generate ---------------------------------------------------------------------------

SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "seed": "--seed", "n": "--n", "beam_width": "--beam-width",
                  "length_penalty": "--length-penalty"}
WEIGHTS_CHOICES = ("native", "float32")
KV_DTYPE_HELP = ("what the KV cache stores: auto (the model's dtype), float16 or bfloat16 (half a float32 cache), "
                 "int8 (codes and a scale per token and KV head)")
COMPILE_HELP = ("decode steps through one torch.compile'd graph of the model: faster steps after a compile "
                "of a minute or two on first use (docs/engine.md#compiled-decode)")
INVARIANT_HELP = ("each request's tokens and log-probabilities the same, bit for bit, whatever else is in its batch or "
                  "the cache: every query token runs as a forward of its own, slower (docs/engine.md#batch-invariant-mode)")
WEIGHTS_HELP = ("a GGUF file's weights: native runs its Q4/Q8 blocks through torch's int4/int8 kernels (default); "
                "float32 de-quantizes them at load, the reference (docs/quantization.md)")
DISAGGREGATION_FLAGS = {"engine.disaggregation.prefill_instances": "--prefill-instances",
                        "engine.disaggregation.decode_instances": "--decode-instances",
                        "engine.disaggregation.router": "--router"}
ENGINE_FLAGS = {"engine.speculative": "--speculative", "engine.speculative.draft_model": "--speculative",
                "engine.speculative.num_tokens": "--num-draft-tokens",
                "engine.weight_quant": "--weight-quant", "engine.quant_group_size": "--weight-quant",
                "engine.weights": "--weights",
                "engine.kv_cache_dtype": "--kv-cache-dtype", "engine.tensor_parallel": "--tensor-parallel",
                "engine.compile_decode": "--compile-decode", "engine.batch_invariant": "--batch-invariant",
                "sampling.n": "--n", "sampling.beam_width": "--beam-width", **DISAGGREGATION_FLAGS}
TP_HELP = ("shard the model over N ranks, processes on torch.distributed (gloo on CPU, NCCL on CUDA); N must divide "
           "the attention heads; under torchrun give the same N as its ranks (docs/engine.md#tensor-parallelism)")


def add_disaggregation_flags(parser: argparse.ArgumentParser, also: str = "") -> None:
    """--prefill-instances, --decode-instances, --router: any of them runs prefill and decode on instances
    of their own (1 of each unless given)."""
    doc = "docs/engine.md#disaggregated-prefill-and-decode"
    parser.add_argument("--prefill-instances", type=int, metavar="N",
                        help=f"prefill and decode on separate instances: N that run prompts ({doc}){also}")
    parser.add_argument("--decode-instances", type=int, metavar="N",
                        help=f"prefill and decode on separate instances: N that run decodes{also}")
    parser.add_argument("--router", choices=("round_robin", "least_loaded"),
                        help=f"how a request picks its prefill and its decode instance (default round_robin){also}")


def disaggregation_of(args: argparse.Namespace) -> dict | None:
    """engine.disaggregation from the flags; None when none was given."""
    given = {"prefill_instances": args.prefill_instances, "decode_instances": args.decode_instances,
             "router": args.router}
    return {k: v for k, v in given.items() if v is not None} or None


def cmd_generate(args: argparse.Namespace) -> None:
    from kvscope.backend.config import MAX_MODEL_LEN, EngineConfig
    from kvscope.backend.engine.engine import Engine
    from kvscope.backend.engine.request import RequestError
    from kvscope.backend.engine.sampling_params import SamplingParams
    from kvscope.backend.engine.tp_group import RankFailed
    from kvscope.backend.model.loader import load_model

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, seed=args.seed, n=args.n, beam_width=args.beam_width,
                                length_penalty=args.length_penalty)
    except ValidationError as e:
        error = validation_error(e)
        raise UserError(SAMPLING_FLAGS.get(error.field, error.field), error.reason) from None
    speculative = None if args.speculative == "off" else {"method": args.speculative, "num_tokens": args.num_draft_tokens}
    loaded = load_model(args.model, weights=args.weights)
    context = min(loaded.config.max_position_embeddings, MAX_MODEL_LEN)  # a longer context is the model's, not ours
    try:
        config = EngineConfig(max_model_len=context, num_blocks=None, events="off", speculative=speculative,
                              weight_quant=args.weight_quant, kv_cache_dtype=args.kv_cache_dtype, weights=args.weights,
                              tensor_parallel=args.tensor_parallel, compile_decode=args.compile_decode,
                              batch_invariant=args.batch_invariant)
    except ValidationError as e:  # only flags reach the config: name the one that was wrong
        error = validation_error(e, "engine")
        raise UserError(ENGINE_FLAGS.get(str(error.field), str(error.field)), error.reason) from None
    try:
        engine = Engine(loaded, config)
        if config.compile_decode:
            print(f"decode step compiled in {engine.runtime.compile_s:.1f} s", file=sys.stderr)
        req = engine.add_request("cli", args.prompt, args.max_tokens, params)
    except RequestError as e:
        flag = {"prompt": "--prompt", "max_tokens": "--max-tokens", **ENGINE_FLAGS}.get(e.field, e.field)
        raise UserError(str(flag), str(e.reason)) from None
    try:
        while engine.has_unfinished():
            engine.step()
    except KeyboardInterrupt:
        raise Interrupted(f"stopped by Ctrl-C after {len(req.seq.output_token_ids)} of {args.max_tokens} "
                          "tokens") from None
    except RankFailed as e:
        raise UserError("--tensor-parallel", str(e)) from None
    finally:
        engine.close()
    if not req.multi:
        print(req.output_text)
        return
    for i, out in enumerate(req.outputs):  # n samples in order, or the best beams first
        score = f", score {out['score']:.3f}" if out["score"] is not None else ""
        print(f"--- {i + 1} (log-prob {out['cumulative_logprob']:.2f}{score}, {out['finish_reason']})")
        print(out["output_text"])


# ---- kvscope serve / replay -----------------------------------------------------------------------

def port_number(text: str) -> int:
    """argparse type of --port and --ui-port: 1..65535 (port 0 would listen on a random port)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return int(text)


def cmd_serve(args: argparse.Namespace) -> None:
    """The API on --port and, unless --no-ui, the dashboard on --ui-port (replay: opened on the trace)."""
    from kvscope.backend.events.trace import read_trace
    from kvscope.backend.server.app import create_app, new_token
    from kvscope.backend.server.serve import is_loopback, serve_forever

    events = read_trace(args.trace) if getattr(args, "trace", None) else None
    if not args.no_ui and args.ui_port == args.port:
        raise UserError(f"--ui-port {args.ui_port}", "the same port as --port; the dashboard needs its own")
    with _listen(args.host, args.port, "--port") as api_socket:
        if not args.no_ui:
            _listen(args.host, args.ui_port, "--ui-port").close()  # NiceGUI binds it itself; fail before starting
        manager, run_id = _start_manager(args, events)
        token = None if is_loopback(args.host) else new_token()
        local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        dashboard = None if args.no_ui else f"http://{local}:{args.ui_port}"
        app = create_app(manager, token=token, max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origin or None,
                         host=args.host, public_watch=args.public_watch, dashboard_origin=dashboard,
                         limits=_limits(args))
        if events is None:  # after create_app, which gives the manager the limits the run is built under
            manager.start_api_run_in_background()  # /health turns 200 without a first request
        served = f"the API on {args.host}:{args.port}" + ("" if args.no_ui else f" and the dashboard on {dashboard}")
        try:
            if args.no_ui:
                _print_api(args, token)  # the socket listens already: clients that connect now are served
                serve_forever(app, api_socket)
            else:
                _serve_with_dashboard(app, api_socket, args, token, run_id)
        except KeyboardInterrupt:
            raise Interrupted(f"stopped by Ctrl-C: in-flight requests aborted, {served} closed") from None


def _limits(args: argparse.Namespace):
    """The service's limits from the flags (limits.py has the defaults)."""
    from pathlib import Path

    from kvscope.backend.server.limits import ServiceLimits

    if args.trace_dir and not Path(args.trace_dir).is_dir():
        raise UserError(f"--trace-dir {args.trace_dir}: not a folder")
    names = ("max_kv_memory_mb", "max_run_kv_memory_mb", "max_weight_memory_mb", "max_replay_memory_mb", "max_runs",
             "max_waiting", "request_timeout_s", "max_viewers", "viewer_events_per_s", "paused_ttl_s",
             "stall_timeout_s", "history", "trace_window", "trace_dir", "api_events", "max_tensor_parallel",
             "grammar_timeout_s", "max_grammar_compiles", "grammar_cache_mb", "stored_responses_mb",
             "stored_response_ttl_s")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return ServiceLimits(allow_paths=args.allow_paths, served_models=(args.model,) if args.model else (), **given)


def positive(kind: type):
    """argparse type: a number > 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
        return value

    return parse


def _start_manager(args: argparse.Namespace, events: list[dict] | None):
    """The server's runs: the --model loaded (serve, or replay given --model), the replay run opened."""
    from kvscope.backend.model.quant import weight_bytes
    from kvscope.backend.model.sharding import check_tensor_parallel
    from kvscope.backend.run import cached_model
    from kvscope.backend.server.api_run import ApiEngineFlags
    from kvscope.backend.server.manager import RunManager

    model, weights = args.model or "demo", getattr(args, "weights", "native")
    tp = getattr(args, "tensor_parallel", 1)
    if args.command == "serve" or args.model:
        # Seconds to a minute for a real model: say what is happening, then what was loaded
        print(f"loading {model} (weights: {weights}) ...", flush=True)
        started = time.perf_counter()
        loaded = cached_model(model, weights)  # a model that cannot load fails now, not as a 503 on the first request
        print(f"loaded {loaded.name} in {time.perf_counter() - started:.1f} s: {loaded.config.num_hidden_layers} "
              f"layers, {weight_bytes(loaded.model) / 2**20:,.1f} MiB of weights held", flush=True)
        try:
            check_tensor_parallel(loaded.config, tp)
        except KvscopeError as e:
            raise UserError(f"--tensor-parallel {tp}", e.reason) from None
    split = disaggregation_of(args) if args.command == "serve" else None
    flags = ApiEngineFlags(weights, tp, getattr(args, "compile_decode", False), getattr(args, "batch_invariant", False),
                           split, getattr(args, "kv_cache_dtype", "auto"))
    check_api_engine(model, flags)
    manager = RunManager(default_model=model, library=_library(args), api_flags=flags)
    if events is None:
        return manager, None
    run_id = manager.start_replay(events, paused=True).run_id
    print(f"replaying {args.trace} as run {run_id} ({len(events)} events)")
    return manager, run_id


def check_api_engine(model: str, flags) -> None:
    """The API runs' engine settings, refused now, naming the flag, rather than at the first request."""
    from pydantic import ValidationError

    from kvscope.backend.engine.disaggregated import check_disaggregation
    from kvscope.backend.engine.request import RequestError
    from kvscope.backend.server.api_run import api_engine

    try:
        config = api_engine(model, flags=flags)
        if config.disaggregation is not None:
            check_disaggregation(config)
    except ValidationError as e:
        error = validation_error(e, "engine")
        raise UserError(ENGINE_FLAGS.get(str(error.field), str(error.field)), error.reason) from None
    except RequestError as e:
        raise UserError(ENGINE_FLAGS.get(e.field, e.field), e.reason) from None


def _library(args: argparse.Namespace):
    """The run library of --library (default: the user's data folder), or None with --no-library."""
    from pathlib import Path

    from kvscope.backend.server.library import DEFAULT_MAX_MB, RunLibrary, default_folder

    if args.no_library:
        return None
    folder = Path(args.library).expanduser() if args.library else default_folder()
    try:
        library = RunLibrary(folder, args.library_max_mb or DEFAULT_MAX_MB)
    except OSError as e:
        raise UserError(f"--library {folder}", f"cannot use this folder ({e.strerror or e})") from None
    print(f"finished runs are saved in {folder} (--library; --no-library keeps none)", flush=True)
    return library


def _listen(host: str, port: int, flag: str):
    """A socket listening on host:port, or a UserError naming the flag that chose it."""
    import errno

    from kvscope.backend.server.serve import listen

    try:
        return listen(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"{flag} {port}", f"in use (another program listens on {host}:{port}); "
                                                  "pick another port") from None
        if e.errno == errno.EACCES:
            raise UserError(f"{flag} {port}", "permission denied (ports below 1024 need privileges); "
                                              "pick another port") from None
        raise UserError(f"--host {host}", f"cannot listen there ({e.strerror or e})") from None


def _print_api(args: argparse.Namespace, token: str | None) -> None:
    print(f"kvscope API on http://{args.host}:{args.port} (OpenAPI at /schema/openapi.json)", flush=True)
    if token:
        print(f"changing runs needs the header  Authorization: Bearer {token}", flush=True)


def _serve_with_dashboard(app, api_socket, args: argparse.Namespace, token: str | None, run_id: str | None) -> None:
    """The API on a thread, the dashboard (NiceGUI, which wants the main thread) in the foreground."""
    from kvscope.backend.server.serve import announce_when_listening, serve_in_thread
    from kvscope.frontend.app import page_url, run_dashboard

    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    with serve_in_thread(app, api_socket):
        _print_api(args, token)
        lines = [f"kvscope dashboard on http://{local}:{args.ui_port}{page_url(run_id)}"]
        if token:
            lines.append("  (anyone who can open the dashboard can start and control runs through it)")
        announce_when_listening(local, args.ui_port, lines)
        model = args.model if args.model not in (None, "demo") else None
        run_dashboard(f"http://{local}:{args.port}", args.host, args.ui_port, token=token, default_model=model)


# ---- kvscope train ------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> None:
    """Train into --out; a signal saves a checkpoint, prints how to resume and exits 128 + its number."""
    from pathlib import Path

    from kvscope.backend.model_card import write_model_card
    from kvscope.backend.model.train import PRESETS, TrainingStopped, check_out_root, default_out_root, train_model

    if args.model != "all" and args.model not in PRESETS:
        raise UserError(f"--model {args.model}", f"not a preset (choose {', '.join(PRESETS)} or all)")
    for flag, value in (("--steps", args.steps), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}", "must be at least 1")
    out_root = Path(args.out).expanduser() if args.out else default_out_root()
    names = list(PRESETS) if args.model == "all" else [args.model]
    try:
        check_out_root(out_root, names, args.resume)
        for name in names:
            metrics = train_model(name, out_root, steps=args.steps, threads=args.threads, resume=args.resume)
            write_model_card(out_root / name)
            print(f"{name}: {metrics['val_bits_per_char']} bits/char, {metrics['train_seconds']} s; "
                  f"use it with --model {out_root / name}")
    except TrainingStopped as e:
        print(f"stopped at step {e.step}; resume with: {_train_command(args)} --resume", flush=True)
        raise SystemExit(128 + e.signum) from None


def _train_command(args: argparse.Namespace) -> str:
    """The `kvscope train` command line that args came from (without --resume)."""
    import shlex

    words = ["kvscope", "train", "--model", args.model]
    for flag, value in (("--steps", args.steps), ("--threads", args.threads), ("--out", args.out)):
        words += [flag, str(value)] if value is not None else []
    return shlex.join(words)


# ---- kvscope run -------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> None:
    import json

    from kvscope.backend.events.bus import EventBus
    from kvscope.backend.engine.tp_group import RankFailed
    from kvscope.backend.events.trace import TraceWriter
    from kvscope.backend.run import ScenarioRun
    from kvscope.backend.scenario import load_scenario
    from kvscope.backend.report import print_replies, print_summary, progress_bar
    from kvscope.backend.server.run_errors import build_run

    tp = [] if args.tensor_parallel is None else [("engine.tensor_parallel", args.tensor_parallel,
                                                   f"--tensor-parallel {args.tensor_parallel}")]
    invariant = [("engine.batch_invariant", True, "--batch-invariant")] if args.batch_invariant else []
    split = [(f"engine.disaggregation.{k}", v, f"--{k.replace('_', '-')}")
             for k, v in (disaggregation_of(args) or {}).items()]
    scenario = load_scenario(args.scenario, args.set or [], simulate_flags(args) + tp + invariant + split)
    if args.simulate and scenario.simulate is None:
        raise UserError("--simulate", f"needs --model-shape ({args.scenario} has no simulate section)")
    bus = EventBus(level=scenario.engine.events)
    writer = TraceWriter(args.trace) if args.trace else None
    if writer:
        bus.subscribe(writer)  # before the run exists: its header is the trace's first line
    run = None
    try:
        run = build_run(lambda: ScenarioRun(scenario, bus))
        with progress_bar(run.total) as advance:
            summary = run.run(on_step=lambda r: advance(r.num_finished))
    except KeyboardInterrupt:
        raise Interrupted(_run_stopped(run, args.trace)) from None
    except RankFailed as e:
        raise UserError("--tensor-parallel", str(e)) from None
    finally:
        if writer:
            writer.close()
        if run is not None:
            run.engine.close()
    print_summary(summary)
    print_replies(summary, [r.id for r in scenario.requests if r.messages is not None])
    if summary["simulated"]:
        sim = summary["simulated"]
        print(f"simulated: {sim['model_shape']} on {sim['tp']} x {sim['hardware_label']}; times are the roofline "
              f"cost model's (docs/perf_model.md), tokens a seeded stand-in")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=2)


def _run_stopped(run, trace: str | None) -> str:
    """What a Ctrl-C stopped: how far the run got, and where its events so far are."""
    if run is None:
        return "stopped by Ctrl-C while loading the model; nothing ran"
    kept = f"; {trace} holds the events so far" if trace else ""
    return (f"stopped by Ctrl-C at iteration {run.engine.step_no}, {run.num_finished} of {run.total} requests "
            f"finished{kept}")


SIMULATE_FLAGS = {"model_shape": "--model-shape", "hardware": "--hardware", "tp": "--tp",
                  "gpu_memory_utilization": "--gpu-memory-utilization"}


def simulate_flags(args: argparse.Namespace) -> list[tuple[str, object, str]]:
    """--simulate and its flags as scenario overrides (key, value, the flag to blame for a bad value)."""
    given = {key: getattr(args, key) for key in SIMULATE_FLAGS if getattr(args, key) is not None}
    if not args.simulate:
        if given:
            raise UserError(SIMULATE_FLAGS[next(iter(given))], "only with --simulate")
        return []
    return [(f"simulate.{key}", value, f"{SIMULATE_FLAGS[key]} {value}") for key, value in given.items()]


# ---- kvscope export ----------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> None:
    from pathlib import Path

    from kvscope.backend.events.trace import read_trace
    from kvscope.frontend.export import ExportError, check_options, parse_size, render

    out = Path(args.out)
    view = "handout" if args.handout else "moment" if args.moment else args.view
    try:
        check_options(view, out, args.x, args.stride, args.moment)  # before reading what may be a long trace
        size = parse_size(args.size)
        render(read_trace(args.trace), view, out, x=args.x, step=args.step, stride=args.stride, size=size,
               moment=args.moment)
    except ExportError as e:
        where = {"trace": args.trace, "view": f"--view {view}", "out": f"--out {args.out}",
                 "x": f"--x {args.x}", "step": f"--step {args.step}", "stride": f"--stride {args.stride}",
                 "size": f"--size {args.size}", "moment": f"--moment {args.moment}"}[e.field]
        raise UserError(str(where), str(e.reason)) from None
    what = {".json": "Perfetto trace of the timeline", ".gif": "block pool and timeline, animated",
            ".html": "the lesson as a handout"}
    print(f"wrote {out} ({what.get(out.suffix.lower(), view)})")


def cmd_scenarios(args: argparse.Namespace) -> None:
    """Each bundled scenario's name and the first sentence of its description."""
    import re

    from kvscope.backend.scenario import list_scenarios

    scenarios = list_scenarios()
    width = max(len(s.name) for s in scenarios)
    for s in scenarios:
        first = re.split(r"(?<=[.!?])\s", " ".join(s.description.split()), maxsplit=1)[0]
        print(f"{s.name:<{width}}  {first}")


# ---- kvscope whatif -----------------------------------------------------------------------------

def cmd_whatif(args: argparse.Namespace) -> None:
    """One iteration of a model shape on a GPU type, costed by the roofline model (docs/perf_model.md)."""
    import json

    from kvscope.backend.perf.errors import PerfError
    from kvscope.backend.perf.whatif import format_table, whatif

    try:
        result = whatif(args.model_shape, args.hardware, args.batch, args.context, prefill=args.prefill, tp=args.tp,
                        kv_cache_dtype=args.kv_cache_dtype, weight_quant=args.weight_quant,
                        quant_group_size=args.quant_group_size, link=args.link,
                        fixed_s=None if args.fixed_ms is None else args.fixed_ms / 1e3)
    except PerfError as e:
        raise UserError(f"--{e.field.replace('_', '-')}", str(e.reason)) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))


def cmd_whatif_disaggregated(args: argparse.Namespace) -> None:
    """A request mix on prefill and decode instances against colocated engines on as many GPUs, priced
    (docs/perf_model.md#disaggregated-prefill-and-decode)."""
    import json

    from kvscope.backend.perf.disaggregation import compare, format_table
    from kvscope.backend.perf.errors import PerfError

    try:
        result = compare(args.model_shape, args.hardware, args.prompt_tokens, args.output_tokens, args.rate,
                         args.prefill_instances, args.prefill_tp, args.decode_instances, args.decode_tp, args.link,
                         args.colocated_instances, args.colocated_tp, args.chunk_tokens, args.max_batch,
                         args.kv_cache_dtype, args.weight_quant)
    except PerfError as e:
        raise UserError(f"--{e.field.replace('_', '-')}", str(e.reason)) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))


def cmd_schema(args: argparse.Namespace) -> None:
    import json

    if args.what == "events":
        from kvscope.backend.events.schema import json_schema

        schema = json_schema()
    else:
        from kvscope.backend.scenario import Scenario

        schema = Scenario.model_json_schema()
    print(json.dumps(schema, indent=2))


# ---- wiring ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvscope", description="A watchable LLM inference engine.")
    from kvscope.backend.model.packages import installed_version

    parser.add_argument("--version", action="version", version=f"kvscope {installed_version()}")
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
    g.add_argument("--weights", choices=WEIGHTS_CHOICES, default="native", help=WEIGHTS_HELP)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_DTYPE_HELP)
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help=TP_HELP)
    g.add_argument("--compile-decode", action="store_true", help=COMPILE_HELP)
    g.add_argument("--batch-invariant", action="store_true", help=INVARIANT_HELP)
    g.set_defaults(func=cmd_generate)

    for name, helptext in (("serve", "start the backend (and the dashboard)"),
                           ("replay", "serve a recorded trace for replay, no model needed")):
        v = sub.add_parser(name, help=helptext)
        if name == "replay":
            v.add_argument("trace", help="a trace .jsonl file")
        v.add_argument("--host", default="127.0.0.1", help="non-loopback hosts require a bearer token")
        v.add_argument("--port", type=port_number, default=8000, help="the API's port (1-65535)")
        v.add_argument("--ui-port", type=port_number, default=8080, help="the dashboard's port (1-65535)")
        v.add_argument("--no-ui", action="store_true", help="the API only, no dashboard")
        v.add_argument("--model", default=None if name == "replay" else "demo",
                       help="model of the OpenAI-compatible API (loaded at start; replay: demo, loaded on first use)")
        if name == "serve":
            v.add_argument("--weights", choices=WEIGHTS_CHOICES, default="native", help=WEIGHTS_HELP)
            v.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help=TP_HELP)
            v.add_argument("--compile-decode", action="store_true", help=COMPILE_HELP)
            v.add_argument("--batch-invariant", action="store_true", help=INVARIANT_HELP)
            v.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_DTYPE_HELP)
            add_disaggregation_flags(v, "; every API run's")
        v.add_argument("--cors-origin", action="append", help="allow this browser origin (CORS is off by default)")
        v.add_argument("--public-watch", action="store_true",
                       help="off loopback, let anyone watch runs (websocket, trace, snapshot) without the token")
        v.add_argument("--max-body-bytes", type=int, default=2_000_000, help="larger request bodies get 413")
        lim = v.add_argument_group("limits of a server left running (docs/api.md)")
        lim.add_argument("--max-kv-memory-mb", type=positive(float),
                         help="KV cache memory of all runs together (default: a quarter of physical memory)")
        lim.add_argument("--max-run-kv-memory-mb", type=positive(float), help="KV cache memory of one run")
        lim.add_argument("--max-weight-memory-mb", type=positive(float),
                         help="weight copies of all runs together; runs of one model and settings share one "
                              "(default: a quarter of physical memory)")
        lim.add_argument("--max-replay-memory-mb", type=positive(float),
                         help="parsed traces of the replays held (replays of one trace share one); past it "
                              "opening a replay gets 429 (default: an eighth of physical memory)")
        lim.add_argument("--max-runs", type=positive(int), help="runs held at once (default 16)")
        lim.add_argument("--max-tensor-parallel", type=positive(int),
                         help="ranks (processes) one run may start with engine.tensor_parallel (default: the cores)")
        lim.add_argument("--max-waiting", type=positive(int), help="requests waiting in a run; more get 429 (default 64)")
        lim.add_argument("--request-timeout-s", type=positive(float), help="a /v1 request is aborted after this (600)")
        lim.add_argument("--max-viewers", type=positive(int), help="websocket viewers per run (default 32)")
        lim.add_argument("--viewer-events-per-s", type=positive(float),
                         help="sent to all websocket viewers together, so that they cannot starve the engine (4000)")
        lim.add_argument("--paused-ttl-s", type=positive(float),
                         help="a run left paused this long expires; the api run resumes (default 900)")
        lim.add_argument("--stall-timeout-s", type=positive(float),
                         help="a run whose step takes longer fails; the api run restarts (default 300)")
        lim.add_argument("--grammar-timeout-s", type=positive(float),
                         help="a client's grammar (response_format, guided_*, forced tools) compiles off the run's "
                              "worker; past this a 400 names the field (default 30)")
        lim.add_argument("--max-grammar-compiles", type=positive(int),
                         help="grammars compiling at once, server-wide; one more gets 429 (default 2)")
        lim.add_argument("--grammar-cache-mb", type=positive(float),
                         help="compiled grammars one run keeps, by xgrammar's own measure (default 256)")
        lim.add_argument("--stored-responses-mb", type=positive(float),
                         help="responses kept for previous_response_id (store: true), by their JSON's bytes; the "
                              "oldest go first (default 64)")
        lim.add_argument("--stored-response-ttl-s", type=positive(float),
                         help="how long a stored response is kept (default 3600)")
        lim.add_argument("--history", type=positive(int), help="finished requests the api run keeps (default 256)")
        lim.add_argument("--trace-window", type=positive(int), help="events the api run keeps in memory (20000)")
        lim.add_argument("--api-events", choices=("full", "summary", "off"),
                         help="what the api run records for the trace and the dashboard; its answers are the "
                              "same at every level, off is the cheapest (default full)")
        lim.add_argument("--trace-dir", help="write every run's whole trace to DIR/<run_id>.jsonl (never over an "
                                             "earlier one: DIR/<run_id>-N.jsonl)")
        lib = v.add_argument_group("the run library: finished runs kept on disk (docs/dashboard.md#run-library)")
        lib.add_argument("--library", metavar="DIR",
                         help="save every finished run here (default: $XDG_DATA_HOME/kvscope/library, "
                              "or ~/.local/share/kvscope/library)")
        lib.add_argument("--library-max-mb", type=positive(float),
                         help="the library's size; the oldest runs go first to make room (default 2048)")
        lib.add_argument("--no-library", action="store_true", help="keep no library: runs live in memory only")
        lim.add_argument("--allow-paths", action="store_true",
                         help="let clients name scenario files and model folders on this machine")
        v.set_defaults(func=cmd_serve)

    r = sub.add_parser("run", help="run a scenario headless and print its metrics")
    r.add_argument("scenario", help="a scenario file, or the name of one in scenarios/")
    r.add_argument("--trace", help="write every event to this JSONL file")
    r.add_argument("--report", help="write the summary to this JSON file")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field, e.g. engine.block_size=8 (value parsed as YAML)")
    r.add_argument("--tensor-parallel", type=int, metavar="N", help=TP_HELP + "; the same as --set engine.tensor_parallel=N")
    r.add_argument("--batch-invariant", action="store_true",
                   help=INVARIANT_HELP + "; the same as --set engine.batch_invariant=true")
    add_disaggregation_flags(r, "; the same as --set engine.disaggregation.<field>=VALUE")
    r.add_argument("--simulate", action="store_true",
                   help="no weights: the scheduler runs, each iteration is priced by the roofline cost model")
    r.add_argument("--model-shape", help="simulate: e.g. llama-3-8b, llama-3-70b, deepseek-v2-lite")
    r.add_argument("--hardware", help="simulate: h100 (default), h200, a100-80gb, l4, rtx-4090 or this-machine")
    r.add_argument("--tp", type=int, help="simulate: tensor-parallel GPUs, 1 (default), 2, 4 or 8")
    r.add_argument("--gpu-memory-utilization", type=float,
                   help="simulate: share of GPU memory for weights plus KV pool (default 0.9)")
    r.set_defaults(func=cmd_run)

    ls = sub.add_parser("scenarios", help="list the bundled scenarios (run one with `kvscope run NAME`)")
    ls.set_defaults(func=cmd_scenarios)

    e = sub.add_parser("export", help="draw a view of a trace as PNG/SVG, or the timeline as a Perfetto trace")
    e.add_argument("trace", help="a trace .jsonl file")
    e.add_argument("--out", required=True,
                   help="FILE.png, FILE.svg, FILE.json (Chrome/Perfetto trace), FILE.gif (block pool + timeline) or "
                        "FILE.html (--handout)")
    e.add_argument("--view", default="timeline", help="timeline, blocks or batch (default timeline)")
    e.add_argument("--x", default="steps", help="timeline x axis: steps or seconds")
    e.add_argument("--step", type=int, default=None,
                   help="the run as of this iteration (default: the end; blocks: the busiest iteration)")
    e.add_argument("--stride", type=int, default=None,
                   help="GIF: a frame every N iterations (default: every one, sampled down to 80 frames)")
    e.add_argument("--size", default="1920x1080",
                   help="pixels, WIDTHxHEIGHT, or a width alone for 16:9 (default 1920x1080, a slide)")
    e.add_argument("--moment", default=None,
                   help="the lesson step that pauses at this moment (e.g. copy_on_write) as a picture, ringed and "
                        "captioned as the lesson shows it")
    e.add_argument("--handout", action="store_true",
                   help="the whole lesson as one self-contained HTML file (--out FILE.html): each step's text, "
                        "question, answer and picture")
    e.set_defaults(func=cmd_export)

    w = sub.add_parser("whatif", help="one iteration of a model shape on a GPU: FLOPs, bytes, time, bound")
    w.add_argument("--model-shape", required=True, help="e.g. llama-3-8b, deepseek-v2-lite, smollm2-135m")
    w.add_argument("--hardware", required=True, help="h100, h200, a100-80gb, l4, rtx-4090 or this-machine")
    w.add_argument("--batch", type=int, required=True, help="sequences in the step (prompts with --prefill)")
    w.add_argument("--context", type=int, required=True, help="tokens of context (prompt length with --prefill)")
    w.add_argument("--prefill", action="store_true", help="cost the prompts' prefill instead of a decode step")
    w.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: 1, 2, 4 or 8")
    w.add_argument("--kv-cache-dtype", default="auto", help=KV_DTYPE_HELP)
    w.add_argument("--weight-quant", default="none", help="none, int8 or int4")
    w.add_argument("--quant-group-size", type=int, default=64, help="weights per quantization scale (0: per tensor)")
    w.add_argument("--link", default=None, help="override the GPU's link: nvlink4, nvlink3, pcie5 or pcie4; "
                                                "this-machine takes gloo (or nccl between its GPUs), measured once")
    w.add_argument("--fixed-ms", type=float, default=None,
                   help="the step's fixed cost (dispatch, launches, Python) in ms, in place of the profile's: e.g. "
                        "what the roofline view measured for a run on this machine, eager or compiled")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(func=cmd_whatif)

    from kvscope.backend.perf.disaggregation import DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_BATCH
    from kvscope.backend.perf.hardware import INSTANCE_LINKS

    d = sub.add_parser("whatif-disaggregated", help="a request mix on prefill and decode instances against "
                                                    "colocated engines on as many GPUs: TTFT, TPOT, the KV transfer")
    d.add_argument("--model-shape", required=True, help="e.g. llama-3-70b, llama-3-8b, qwen2.5-7b")
    d.add_argument("--hardware", required=True, help="h100, h200, a100-80gb, l4, rtx-4090 or this-machine")
    d.add_argument("--link", default="infiniband", help=f"between the instances: {', '.join(INSTANCE_LINKS)}")
    d.add_argument("--prompt-tokens", type=int, required=True)
    d.add_argument("--output-tokens", type=int, required=True)
    d.add_argument("--rate", type=float, required=True, help="requests per second (Poisson), to all instances")
    d.add_argument("--prefill-instances", type=int, default=1)
    d.add_argument("--prefill-tp", type=int, default=1, help="GPUs per prefill instance: 1, 2, 4 or 8")
    d.add_argument("--decode-instances", type=int, default=1)
    d.add_argument("--decode-tp", type=int, default=1, help="GPUs per decode instance: 1, 2, 4 or 8")
    d.add_argument("--colocated-instances", type=int, default=None, help="default: as many as fill the same GPUs")
    d.add_argument("--colocated-tp", type=int, default=None, help="default: --decode-tp")
    d.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="a step's token budget")
    d.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="sequences an engine decodes at once")
    d.add_argument("--kv-cache-dtype", default="auto", help=KV_DTYPE_HELP)
    d.add_argument("--weight-quant", default="none", help="none, int8 or int4")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_whatif_disaggregated)

    s = sub.add_parser("schema", help="print a JSON Schema")
    s.add_argument("what", choices=["events", "scenario"])
    s.set_defaults(func=cmd_schema)

    t = sub.add_parser("train", help="train the demo models on Tiny Shakespeare (resumable)")
    t.add_argument("--model", default="all", help="demo, demo-draft, demo-mha, demo-mqa, demo-mla or all")
    t.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    t.add_argument("--out", default=None, help="write OUT/NAME/ (default: ~/.cache/kvscope/models, or under "
                   "$XDG_CACHE_HOME); the shipped weights change only if this names backend/models")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    t.set_defaults(func=cmd_train)
    return parser


def run_command(func: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """Run a subcommand; user-facing errors become one line on stderr and exit status 2."""
    try:
        func(args)
    except KvscopeError as e:
        print(f"kvscope {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvscope scenarios | head`: the reader left, which is no error to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second failure when Python flushes
        return 128 + signal.SIGPIPE
    except OSError as e:  # e.g. --trace or --report in a folder that does not exist
        where = f"{e.filename}: " if e.filename else ""
        print(f"kvscope {args.command}: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"kvscope {args.command}: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # a Ctrl-C that no command explained further
        print(f"kvscope {args.command}: stopped by Ctrl-C", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("RANK", "0") != "0":  # torchrun starts every rank with the command; rank 0 runs it
        from kvscope.backend.engine.tp_worker import torchrun_worker

        torchrun_worker()
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)
