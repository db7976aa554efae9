"""`python -m kvscope.frontend --backend http://127.0.0.1:8000 --port 8080`: the dashboard alone, for a
backend started elsewhere (`kvscope serve --no-ui`); `kvscope serve` starts both."""

from __future__ import annotations

import argparse
import sys

from kvscope.frontend.app import run_dashboard


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvscope.frontend", description="kvscope's dashboard")
    parser.add_argument("--backend", default="http://127.0.0.1:8000", help="base URL of the kvscope API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--token", default=None, help="the backend's bearer token, if it has one")
    args = parser.parse_args()
    print(f"kvscope dashboard on http://{args.host}:{args.port} (backend {args.backend})", flush=True)
    try:
        run_dashboard(args.backend, args.host, args.port, args.token)
    except KeyboardInterrupt:
        print(f"kvscope dashboard: stopped by Ctrl-C, http://{args.host}:{args.port} closed", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ in {"__main__", "__mp_main__"}:
    main()
