"""What `kvscope run` shows in the terminal: a progress bar while it runs, a metrics table at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


@contextmanager
def progress_bar(total: int) -> Iterator[Callable[[int], None]]:
    """Yields update(finished_count); drawn on stderr so stdout stays the table."""
    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("run", total=total)
        yield lambda done: bar.update(task, completed=done)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def print_summary(s: dict, console: Console | None = None) -> None:
    table = Table(title=f"kvscope run: {s['scenario']}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests (finished / aborted / rejected)", f"{s['finished']} / {s['aborted']} / {s['rejected']}"),
        ("engine iterations", str(s["steps"])),
        ("output tokens", str(s["output_tokens"])),
        ("prefill tokens computed", str(s["prefill_tokens_computed"])),
        ("throughput", f"{s['tokens_per_s']:.1f} tokens/s"),
        ("TTFT mean / p95", f"{_ms(s['ttft_s']['mean'])} / {_ms(s['ttft_s']['p95'])}"),
        ("TPOT mean / p95", f"{_ms(s['tpot_s']['mean'])} / {_ms(s['tpot_s']['p95'])}"),
        ("end-to-end mean / p95", f"{_ms(s['e2e_s']['mean'])} / {_ms(s['e2e_s']['p95'])}"),
        ("KV usage (mean)", f"{s['kv_usage_mean']:.1%}"),
        ("KV waste (mean, reserved but empty)", f"{s['kv_waste_mean']:.1%}"),
        ("prefix cache hit rate", f"{s['prefix_hit_rate']:.1%}"),
        ("preemptions", str(s["num_preemptions"])),
        ("KV blocks saved by sharing (peak)", str(s["peak_kv_blocks_saved_by_sharing"])),
    ]
    if s.get("speculative"):
        spec = s["speculative"]
        rows += [("draft acceptance rate / alpha", f"{spec['spec_acceptance_rate']:.1%} / {spec['spec_alpha']:.3f}"),
                 ("tokens per verify", f"{spec['spec_tokens_per_verify']:.2f}")]
    for name, value in rows:
        table.add_row(name, value)
    (console or Console()).print(table)
    for rid, why in s.get("rejections", {}).items():
        (console or Console(stderr=True)).print(f"rejected {rid}: {why}")


def print_replies(s: dict, request_ids: list[str], console: Console | None = None) -> None:
    """Each chat request's reply under the table: a chat scenario is read for what the model said."""
    if not request_ids:
        return
    console = console or Console()
    console.print("replies")
    for rid in request_ids:
        r = s["per_request"].get(rid)
        if r is None:  # rejected: its reason is printed above
            continue
        console.print(f"  {rid} ({r['finish_reason']}): {r['output_text'].strip()!r}", highlight=False, markup=False)
