"""kvscope: an LLM inference engine whose every decision can be watched.

The package holds its parts as subpackages: `kvscope.backend` (model, engine, events, server),
`kvscope.frontend` (the dashboard), `kvscope.kernels` (Triton) and `kvscope.scenarios` (data), with
`kvscope.cli` the one layer above both the engine and the dashboard. The wheel installs them inside
this folder, so nothing but `kvscope` lands at the top level of site-packages; the repository keeps
them at its top level (pyproject.toml's `package-dir` maps one onto the other).
"""

from pathlib import Path

PARTS = ("backend", "frontend", "kernels", "scenarios")

# A source checkout (a clone on PYTHONPATH, or `pip install -e .`) has the parts beside this folder,
# not inside it: looking there too makes `kvscope.backend` the checkout's own `backend/`. An
# installed wheel has no pyproject.toml beside its package, so its path stays as it is.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and all((_checkout / part / "__init__.py").is_file() for part in PARTS):
    __path__.append(str(_checkout))
