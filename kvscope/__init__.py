"""kvscope: an LLM inference engine whose every decision can be watched.

The package holds its parts as subpackages: `kvscope.backend` (model, engine, events, server),
`kvscope.frontend` (the dashboard), `kvscope.kernels` (Triton) and `kvscope.scenarios` (data), with
`kvscope.cli` the one layer above both the engine and the dashboard. The wheel installs them inside
this folder, so nothing but `kvscope` lands at the top level of site-packages; the repository keeps
them at its top level (pyproject.toml's `package-dir` maps one onto the other).

The parts have no `__init__.py`: they are namespace packages. A checkout's root is first on `sys.path`
whenever Python starts there (`python -m pytest`, `python -c`), and a regular package named `kernels`
at the root would hide Hugging Face's `kernels` (which transformers imports) or any installed
`backend` / `frontend`. A namespace portion never hides a regular package found anywhere on the path,
so the parts are reachable only as `kvscope.<part>` (tests/test_self_contained.py proves it from the root).
"""

from pathlib import Path

PARTS = ("backend", "frontend", "kernels", "scenarios")

# A source checkout (a clone on PYTHONPATH, or `pip install -e .`) has the parts beside this folder,
# not inside it: looking there too makes `kvscope.backend` the checkout's own `backend/`. An
# installed wheel has no pyproject.toml beside its package, so its path stays as it is.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and all((_checkout / part).is_dir() for part in PARTS):
    __path__.append(str(_checkout))


def part_dir(part: str) -> Path:
    """The folder of one part (`scenarios`, `backend`, ...), in a checkout or an installed wheel: a namespace
    package has no `__file__`, and importlib.resources hands it back as several paths in one."""
    import importlib

    return Path(next(iter(importlib.import_module(f"kvscope.{part}").__path__)))

