"""A fresh clone works on its own, and so does the wheel built from it.

The tracked files are copied into an empty folder (no shared/ or anything else beside it) and run from
there with a clean HOME: a few bundled scenarios in the default run, every one and a training run under
`-m slow`. No tracked code or config names the developers' shared/ folder, and the wheel carries every
tracked file of its packages (weights, corpus, scenarios, dashboard files, kernels) inside `kvscope`
alone, and runs from where it is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from kvscope import PARTS
from kvscope.backend.model.loader import missing_package

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kvscope", *PARTS)  # the repository's folders that the wheel installs
# A demo scenario, one with a draft model and one with a quantized model: the default run's sample.
SAMPLE = ("shared-prefix", "speculative-draft", "quantization")


def tracked_files() -> list[str]:
    """`git ls-files` of the repository: what a fresh clone has."""
    try:
        proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    return [name for name in proc.stdout.split("\0") if name and (ROOT / name).is_file()]


def copy_tracked(dest: Path) -> Path:
    for name in tracked_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files alone in an otherwise empty folder, as a fresh clone has them."""
    return copy_tracked(tmp_path_factory.mktemp("fresh") / "kvscope")


@pytest.fixture(scope="module")
def env(clone: Path, tmp_path_factory) -> dict[str, str]:
    """The clone first on the import path, and an empty HOME so that no cache from earlier runs helps."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XDG_CACHE_HOME")}
    return {**env, "PYTHONPATH": str(clone), "HOME": str(tmp_path_factory.mktemp("home"))}


def kvscope(clone: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope", *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_clone_runs_its_own_code_not_an_installed_copy(clone, env):
    modules = ["kvscope", *(f"kvscope.{part}" for part in PARTS)]
    code = f"import {', '.join(modules)}; print(*kvscope.__path__, {', '.join(f'*{m}.__path__' for m in modules[1:])})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(Path(path).is_relative_to(clone) for path in proc.stdout.split()), proc.stdout


def test_no_part_hides_an_installed_package_of_the_same_name(tmp_path):
    """From the repository root (first on sys.path, as under `python -m pytest` or `python -c`), a package
    installed under a part's bare name is the one imported: transformers imports Hugging Face's `kernels`."""
    site = tmp_path / "site"
    for part in ("backend", "frontend", "kernels"):
        (site / part).mkdir(parents=True)
        (site / part / "__init__.py").write_text(f"ORIGIN = 'installed {part}'\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import backend, frontend, kernels, kvscope.kernels.paged_decode; print(backend.ORIGIN, frontend.ORIGIN, kernels.ORIGIN)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["installed", "backend", "installed", "frontend", "installed", "kernels"]


def test_transformers_loads_a_model_from_the_repository_root():
    """transformers >= 5 imports Hugging Face's `kernels` while it loads any model class: the checkout's
    kernels/ must not be the one it finds."""
    pytest.importorskip("transformers")
    code = ("import transformers; from transformers import AutoModelForCausalLM, LlamaConfig; "
            "config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, "
            "num_attention_heads=2, num_key_value_heads=1); "
            "print(type(AutoModelForCausalLM.from_config(config)).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "LlamaForCausalLM"


def short_settings(scenario: Path) -> list[str]:
    """--set overrides that cut a generated workload to two short requests (explicit ones are short already)."""
    if "generate" not in yaml.safe_load(scenario.read_text()):
        return []
    return ["--set", "generate.count=2", "--set", "generate.max_tokens={min: 2, max: 4}"]


def skip_without_its_model(scenario: Path) -> None:
    """A scenario on a model whose package is absent (smollm2) cannot run here: say how to install it."""
    model = yaml.safe_load(scenario.read_text()).get("model", "demo")
    if missing_package(model):
        pytest.skip(f"{scenario.stem} needs {model} ({missing_package(model)})")


@pytest.mark.parametrize("name", [pytest.param(p.stem, marks=() if p.stem in SAMPLE else pytest.mark.slow)
                                  for p in sorted((ROOT / "scenarios").glob("*.yaml"))])
def test_every_bundled_scenario_runs_in_a_fresh_clone(clone, env, name):
    skip_without_its_model(clone / "scenarios" / f"{name}.yaml")  # present: converted into the empty HOME's cache
    proc = kvscope(clone, env, "run", name, *short_settings(clone / "scenarios" / f"{name}.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "requests (finished / aborted / rejected)" in proc.stdout


@pytest.mark.slow
def test_training_runs_in_a_fresh_clone(clone, env, tmp_path):
    proc = kvscope(clone, env, "train", "--model", "demo-draft", "--steps", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "demo-draft" / "model.safetensors").is_file()


# The ways code has reached for the developers' folder beside the repository.
# "shared" as a path part (`/ "shared"`, `"shared" /`), not as a word in a string (a palette's key).
READS_SHARED = re.compile(r"""\.\./shared|/\s*["']shared["']|["']shared["']\s*/|shared/(data|STYLE|PITFALLS|CONTRACT|hooks)|/work/""")


def test_no_tracked_code_or_config_reads_the_shared_folder():
    checked = [name for name in tracked_files() if name != "tests/test_self_contained.py"
               and (name.endswith((".py", ".yaml", ".yml", ".toml")) or name.startswith(".ci/"))]
    assert "backend/model/tokenizer.py" in checked and ".ci/run" in checked
    offenders = [f"{name}:{i}: {line.strip()}" for name in checked
                 for i, line in enumerate((ROOT / name).read_text().splitlines(), 1) if READS_SHARED.search(line)]
    assert offenders == []


def test_pyproject_installs_every_package_folder_under_kvscope():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {path.parent.relative_to(ROOT) for folder in FOLDERS for path in (ROOT / folder).rglob("__init__.py")}
    folders |= {Path(part) for part in PARTS}  # namespace packages: no __init__.py of their own
    assert sorted(setuptools["packages"]) == sorted(".".join(("kvscope", *f.parts) if f.parts[0] != "kvscope"
                                                             else f.parts) for f in folders)
    assert setuptools["package-dir"] == {f"kvscope.{part}": part for part in PARTS}


def installed_name(tracked: str) -> str:
    """Where a tracked file of a package folder lies in the wheel: `backend/x.py` -> `kvscope/backend/x.py`."""
    return tracked if tracked.startswith("kvscope/") else f"kvscope/{tracked}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = copy_tracked(tmp / "src")  # a clean tree: no build/ left from earlier builds
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(tmp / "dist"), "."], cwd=source, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "dist").glob("kvscope-*.whl")
    return built


def test_the_wheel_carries_every_file_of_its_packages_inside_kvscope_alone(wheel):
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in shipped if n.endswith(".dist-info/entry_points.txt"))
    tracked = {name for name in tracked_files() if name.startswith(tuple(f"{f}/" for f in FOLDERS))}
    assert {"backend/models/demo/model.safetensors", "backend/models/demo-draft/config.json",
            "backend/models/tokenizer.json", "backend/data/tinyshakespeare.txt", "scenarios/shared-prefix.yaml",
            "frontend/static/kvscope.js", "frontend/views/block_pool.js", "kernels/paged_decode.py"} <= tracked
    assert sorted({installed_name(name) for name in tracked} - shipped) == []
    assert {name.split("/")[0] for name in shipped} == {"kvscope", f"{wheel.name.split('-py3')[0]}.dist-info"}
    assert "kvscope = kvscope.cli:main" in entry_points


def test_the_installed_wheel_runs_from_site_packages(wheel, tmp_path):
    """Unpacked into a folder of its own (as pip would), away from the checkout: its parts import from
    inside `kvscope`, and the command line finds the bundled scenarios and models there."""
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(target),
           "HOME": str(tmp_path / "home")}
    code = ("import kvscope, kvscope.backend.engine.engine, kvscope.frontend.app; "
            "print(*kvscope.backend.__path__); print(len(kvscope.__path__))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(target / "kvscope" / "backend"), "1"]
    proc = subprocess.run([sys.executable, "-m", "kvscope", "generate", "--prompt", "ROMEO:", "--max-tokens", "3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
