"""`kvscope train`: writes only under --out, checkpoints on the clock and on a signal, resumes exactly.

Training runs the smallest preset (demo-draft) for a handful of steps: mechanics, not quality.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvscope.cli import main
from kvscope.backend import model_card
from kvscope.backend.model import quality, train
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, load_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def few_validation_windows(monkeypatch):
    """Evaluating on 4 windows instead of 170 keeps each run to about a second; the mechanics are the same."""
    few = lambda tokenizer: quality.validation_windows(tokenizer)[:4]  # noqa: E731
    monkeypatch.setattr(train, "validation_windows", few)
    monkeypatch.setattr(model_card, "validation_windows", few)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_default_output_is_the_users_cache_folder_never_the_shipped_models(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert train.default_out_root() == tmp_path / "xdg" / "kvscope" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert train.default_out_root() == tmp_path / "home" / ".cache" / "kvscope" / "models"


def test_training_writes_a_loadable_model_under_out_and_leaves_the_shipped_weights_alone(tmp_path, capsys):
    shipped = SHIPPED_MODELS_DIR / "demo-draft" / "model.safetensors"
    before = sha256(shipped)
    assert main(["train", "--model", "demo-draft", "--steps", "2", "--out", str(tmp_path)]) == 0
    folder = tmp_path / "demo-draft"
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                  "metrics.json", "README.md", "train_state.pt"}
    assert load_model(folder).config.num_hidden_layers == 2
    assert '"steps": 2' in (folder / "metrics.json").read_text()
    assert f"use it with --model {folder}" in capsys.readouterr().out
    assert sha256(shipped) == before


def test_it_refuses_to_start_over_a_checkpoint_and_to_resume_from_none(tmp_path, capsys):
    assert main(["train", "--model", "demo-draft", "--resume", "--out", str(tmp_path)]) == 2
    assert f"--resume: no train_state.pt of demo-draft under {tmp_path}" in capsys.readouterr().err
    (tmp_path / "demo-draft").mkdir()
    (tmp_path / "demo-draft" / "train_state.pt").write_bytes(b"")
    assert main(["train", "--model", "demo-draft", "--out", str(tmp_path)]) == 2
    assert "demo-draft has a checkpoint there; add --resume" in capsys.readouterr().err


def _signal_after_step(monkeypatch, step: int, signum: int) -> None:
    """A real signal to this process right after the given optimizer step."""
    real_step = train._Trainer.step

    def step_then_signal(self, s, data):
        loss = real_step(self, s, data)
        if self.state["step"] == step:
            signal.raise_signal(signum)
        return loss

    monkeypatch.setattr(train._Trainer, "step", step_then_signal)


def test_a_run_stopped_by_sigterm_and_resumed_ends_exactly_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    train.train_model("demo-draft", tmp_path / "straight", steps=3)
    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as m:
        _signal_after_step(m, 1, signal.SIGTERM)
        with pytest.raises(train.TrainingStopped) as stopped:
            train.train_model("demo-draft", tmp_path / "stopped", steps=3)
    assert (stopped.value.step, stopped.value.signum) == (1, signal.SIGTERM)
    assert torch.load(tmp_path / "stopped" / "demo-draft" / "train_state.pt", weights_only=False)["state"]["step"] == 1
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler left with it
    train.train_model("demo-draft", tmp_path / "stopped", steps=3, resume=True)
    straight = load_file(tmp_path / "straight" / "demo-draft" / "model.safetensors")
    resumed = load_file(tmp_path / "stopped" / "demo-draft" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_checkpoint_is_written_once_the_interval_has_passed(tmp_path, monkeypatch):
    saved_at: list[int] = []
    real_save = train._Trainer.save
    monkeypatch.setattr(train._Trainer, "save", lambda self, elapsed_s: (saved_at.append(self.state["step"]),
                                                                         real_save(self, elapsed_s)))
    train.train_model("demo-draft", tmp_path / "quiet", steps=3)
    assert saved_at == [3]  # a short run: only the end
    saved_at.clear()
    monkeypatch.setattr(train, "CHECKPOINT_EVERY_S", 0.0)
    train.train_model("demo-draft", tmp_path / "every", steps=3)
    assert saved_at == [1, 2, 3]


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvscope", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _signal_once_training(proc: subprocess.Popen, signum: int) -> tuple[str, str]:
    """Wait for the 'training ... from step N' line, send the signal; returns that line and the rest."""
    for line in proc.stdout:
        if line.startswith("training demo-draft from step"):
            proc.send_signal(signum)
            rest, _ = proc.communicate(timeout=120)
            return line, rest
    raise AssertionError(f"training never started (exit {proc.wait()})")


def test_sigterm_and_ctrl_c_save_print_the_resume_command_and_exit_143_and_130(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    proc = _start(["--model", "demo-draft", "--steps", "400", "--out", str(out)], env)
    started, rest = _signal_once_training(proc, signal.SIGTERM)
    assert started.startswith("training demo-draft from step 0 of 400")
    assert proc.returncode == 143, rest
    found = re.search(r"stopped at step (\d+); resume with: (kvscope train .*)\n", rest)
    assert found, rest
    step, command = int(found.group(1)), found.group(2)
    assert step >= 1
    assert command == f"kvscope train --model demo-draft --steps 400 --out {out} --resume"

    resumed = _start(command.split()[2:], env)  # the printed command, verbatim
    started, rest = _signal_once_training(resumed, signal.SIGINT)
    assert started.startswith(f"training demo-draft from step {step} of 400")
    assert resumed.returncode == 130, rest
    assert int(re.search(r"stopped at step (\d+); resume with", rest).group(1)) > step
