"""The command line: `kvscope generate` works, and bad input ends in exit 2 with one clear line."""

import json
import shutil
import subprocess
import sys

import pytest

from kvscope.cli import main
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err


@pytest.fixture
def demo_copy(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(SHIPPED_MODELS_DIR / "demo", folder, ignore=shutil.ignore_patterns("train_state.pt"))
    return folder


def test_generate_greedy_prints_the_reference_completion(capsys, demo):
    from kvscope.backend.engine.sampling_params import SamplingParams
    from kvscope.backend.engine.reference import reference_generate

    code, out, _ = run_cli(capsys, "generate", "--prompt", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0")
    prompt = demo.tokenizer.encode("ROMEO:\n")
    expected = reference_generate(demo.model, prompt, 12, SamplingParams(temperature=0), demo.tokenizer.eos_token_ids)
    assert code == 0
    assert out == demo.tokenizer.decode([t for t in expected if t != 0]) + "\n"


def test_generate_with_seed_is_repeatable_and_seed_matters(capsys):
    args = ["generate", "--prompt", "KING:", "--max-tokens", "16", "--temperature", "1.0", "--top-k", "50",
            "--top-p", "0.9", "--min-p", "0.01"]
    first = run_cli(capsys, *args, "--seed", "1")[1]
    again = run_cli(capsys, *args, "--seed", "1")[1]
    other = run_cli(capsys, *args, "--seed", "2")[1]
    assert first == again and first != other


def test_missing_model_folder(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--model", str(tmp_path / "nope"))
    assert_one_line_error(code, err, "nope", "no such model folder")


def test_corrupt_weights(capsys, demo_copy):
    (demo_copy / "model.safetensors").write_bytes(b"not a safetensors file at all")
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--model", str(demo_copy))
    assert_one_line_error(code, err, "model.safetensors", "corrupt")


def test_corrupt_config(capsys, demo_copy):
    (demo_copy / "config.json").write_text("{ nope")
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--model", str(demo_copy))
    assert_one_line_error(code, err, "config.json", "not valid JSON")


def test_unknown_architecture(capsys, demo_copy):
    cfg = json.loads((demo_copy / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (demo_copy / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--model", str(demo_copy))
    assert_one_line_error(code, err, "config.json", "GPTNeoXForCausalLM")


def test_mismatched_tensor_shapes(capsys, demo_copy):
    cfg = json.loads((demo_copy / "config.json").read_text())
    cfg["intermediate_size"] = 1024
    (demo_copy / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--model", str(demo_copy))
    assert_one_line_error(code, err, "mlp", "shape")


def test_missing_tokenizer(capsys, demo_copy):
    (demo_copy / "tokenizer.json").unlink()
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--model", str(demo_copy))
    assert_one_line_error(code, err, "tokenizer.json", "missing")


def test_prompt_longer_than_the_context(capsys):
    code, _, err = run_cli(capsys, "generate", "--prompt", "ROMEO: " * 2000)
    assert_one_line_error(code, err, "--prompt", "max_model_len=1024")


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "nan"),
                                        ("--min-p", "2"), ("--top-k", "-3")])
def test_bad_sampling_values(capsys, flag, value):
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", flag, value)
    assert_one_line_error(code, err, flag)


def test_installed_console_script_reports_errors_without_traceback(tmp_path):
    exe = shutil.which("kvscope") or pytest.skip("kvscope is not installed as a script")
    proc = subprocess.run([exe, "generate", "--prompt", "x", "--model", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "config.json" in proc.stderr


def test_module_entry_point_prints_help():
    proc = subprocess.run([sys.executable, "-m", "kvscope", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout


def test_generate_with_n_beams_speculation_and_quantization(capsys, demo, draft):
    code, out, _ = run_cli(capsys, "generate", "--prompt", "ROMEO:\n", "--max-tokens", "8", "--n", "3",
                           "--temperature", "1.0", "--seed", "3")
    assert code == 0 and out.count("--- ") == 3
    code, beams, _ = run_cli(capsys, "generate", "--prompt", "ROMEO:\n", "--max-tokens", "8", "--beam-width", "3",
                             "--n", "2")
    assert code == 0 and beams.count("--- ") == 2 and "score" in beams
    _, greedy, _ = run_cli(capsys, "generate", "--prompt", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0")
    for method in ("draft", "ngram"):
        code, spec, _ = run_cli(capsys, "generate", "--prompt", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0",
                                "--speculative", method, "--num-draft-tokens", "3")
        assert code == 0 and spec == greedy  # exact: speculation never changes greedy output
    code, quant, _ = run_cli(capsys, "generate", "--prompt", "ROMEO:\n", "--max-tokens", "4", "--temperature", "0",
                             "--weight-quant", "int8", "--kv-cache-dtype", "int8")
    assert code == 0 and quant.strip()


def test_generate_refuses_bad_multi_sequence_and_speculative_flags(capsys):
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--beam-width", "2", "--n", "3")
    assert_one_line_error(code, err, "--n", "beam_width=2")
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--beam-width", "2", "--speculative", "ngram")
    assert_one_line_error(code, err, "--beam-width", "speculative")
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--speculative", "ngram", "--num-draft-tokens", "99")
    assert_one_line_error(code, err, "--num-draft-tokens")
