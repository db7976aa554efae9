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
                  "min_p": "--min-p", "seed": "--seed"}


def cmd_generate(args: argparse.Namespace) -> None:
    from backend.engine.sampling_params import SamplingParams
    from backend.model.loader import load_model
    from backend.model.reference import reference_generate

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, seed=args.seed)
    except ValidationError as e:
        field = e.errors()[0]["loc"][0]
        raise UserError(f"{SAMPLING_FLAGS.get(str(field), field)}: {e.errors()[0]['msg']}") from None
    if args.max_tokens < 1:
        raise UserError("--max-tokens: must be at least 1")
    loaded = load_model(args.model)
    prompt_ids = loaded.tokenizer.encode(args.prompt)
    context = loaded.config.max_position_embeddings
    if not prompt_ids:
        raise UserError("--prompt: empty prompt")
    if len(prompt_ids) >= context:
        raise UserError(f"--prompt: {len(prompt_ids)} tokens do not fit the model's context of {context} tokens")
    max_tokens = min(args.max_tokens, context - len(prompt_ids))
    out = reference_generate(loaded.model, prompt_ids, max_tokens, params, loaded.tokenizer.eos_token_ids)
    text_ids = [t for t in out if t not in loaded.tokenizer.eos_token_ids]
    print(loaded.tokenizer.decode(text_ids))


# ---- kvscope train ------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> None:
    from backend.model.train import PRESETS, train_model
    from backend.model.model_card import write_model_card

    names = list(PRESETS) if args.model == "all" else [args.model]
    for name in names:
        metrics = train_model(name, steps=args.steps, threads=args.threads)
        write_model_card(name)
        print(f"{name}: {metrics['val_bits_per_char']} bits/char, {metrics['train_seconds']} s")


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
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train", help="train the demo models on Tiny Shakespeare (resumable)")
    t.add_argument("--model", default="all", help="demo, demo-draft, demo-mha, demo-mqa, demo-mla or all")
    t.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    t.set_defaults(func=cmd_train)
    return parser


def run_command(func: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """Run a subcommand; user-facing errors become one line on stderr and exit status 2."""
    from backend.model.loader import ModelLoadError

    try:
        func(args)
    except (UserError, ModelLoadError) as e:
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
