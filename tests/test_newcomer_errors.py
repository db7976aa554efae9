"""Every error a newcomer can meet is one line naming what to fix, exit 2 (CLI) or a 4xx (HTTP)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.cli import build_parser, main
from kvscope.backend.scenario import SCENARIOS_DIR, list_scenarios
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import free_port
from tests.server_helpers import in_process, live_server

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ---- kvscope scenarios, and pointers to commands that exist ------------------------------------------


def test_scenarios_lists_every_bundled_scenario_with_its_first_sentence(capsys):
    code, out, _ = run_cli(capsys, "scenarios")
    lines = out.strip().splitlines()
    scenarios = list_scenarios()
    assert code == 0 and len(lines) == len(scenarios) == len(list(SCENARIOS_DIR.glob("*.yaml")))
    for line, s in zip(lines, scenarios):
        name, text = line.split(maxsplit=1)
        assert name == s.name and " ".join(s.description.split()).startswith(text)
        assert text.endswith((".", "!", "?")) and not re.search(r"[.!?]\s", text)  # exactly one sentence


def test_every_command_a_message_or_doc_points_at_exists(capsys):
    parser = build_parser()
    commands = set(next(a for a in parser._actions if a.dest == "command").choices)
    commands |= {option for a in parser._actions for option in a.option_strings}  # `kvscope --version`
    files = [*ROOT.glob("backend/**/*.py"), *ROOT.glob("frontend/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    named = {(m, f.name) for f in files for m in re.findall(r"`kvscope ([a-z-]+)", f.read_text(encoding="utf-8"))}
    assert {m for m, _ in named} >= {"scenarios", "run", "serve"}
    assert not {(m, f) for m, f in named if m not in commands}
    code, _, err = run_cli(capsys, "run", "no-such-scenario")
    assert "`kvscope scenarios`" in one_line_error(code, err)


# ---- --set and scenario files ------------------------------------------------------------------------


@pytest.mark.parametrize("assignment,reason", [
    ("engine.block_size=-1", "greater than or equal to 1"),
    ("engine.max_num_seq=4", "unknown field; did you mean engine.max_num_seqs?"),
    ("engine.speculative.num_tokenz=3", "unknown field; did you mean engine.speculative.num_tokens?"),
    ("generate.sampling.temprature=0.5", "unknown field; did you mean generate.sampling.temperature?"),
    ("generate.prompt_tokens.min=100000", "is larger than max"),
])
def test_set_errors_name_the_assignment_not_the_file(capsys, assignment, reason):
    code, _, err = run_cli(capsys, "run", "shared-prefix", "--set", assignment)
    line = one_line_error(code, err)
    assert line.startswith(f"kvscope run: --set {assignment}: ") and reason in line
    assert ".yaml" not in line


def test_unknown_keys_in_a_file_suggest_the_closest_field(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nrequests:\n  - id: a\n    prompt: x\n    sampling: {tempreture: 0}\n")
    code, _, err = run_cli(capsys, "run", str(path))
    assert one_line_error(code, err) == (f"kvscope run: {path}: requests.0.sampling.tempreture: unknown field; "
                                         "did you mean requests.0.sampling.temperature?")


def test_yaml_syntax_errors_are_file_line_col(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nengine:\n  block_size: [8\n  num_blocks: 4\n")
    code, _, err = run_cli(capsys, "run", str(path))
    assert re.fullmatch(rf"kvscope run: {re.escape(str(path))}:\d+:\d+: [^\n]+", one_line_error(code, err))
    path.write_text("name: s\n\tengine: {}\n")  # a tab where YAML wants spaces: line 2, column 1
    code, _, err = run_cli(capsys, "run", str(path))
    assert one_line_error(code, err).startswith(f"kvscope run: {path}:2:1: found character '\\t'")


def test_a_run_whose_engine_cannot_start_is_one_line(capsys, monkeypatch):
    def refuse(*_, **__):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\n  at alloc_cpu.cpp:127")

    monkeypatch.setattr("kvscope.backend.run.ScenarioRun", refuse)
    code, _, err = run_cli(capsys, "run", "shared-prefix")
    assert one_line_error(code, err) == \
        "kvscope run: the run could not start: RuntimeError: DefaultCPUAllocator: can't allocate memory"


def test_files_that_cannot_be_written_or_read_are_named(capsys, never_serves, tmp_path):
    code, _, err = run_cli(capsys, "run", "shared-prefix", "--trace", str(tmp_path / "no" / "t.jsonl"))
    assert one_line_error(code, err) == f"kvscope run: {tmp_path / 'no' / 't.jsonl'}: No such file or directory"
    code, _, err = run_cli(capsys, "replay", "missing.jsonl")
    assert one_line_error(code, err) == "kvscope replay: missing.jsonl: no such trace file"


# ---- kvscope serve: ports and model --------------------------------------------------------------------


@pytest.fixture
def never_serves(monkeypatch):
    """These commands must fail before serving: if one regresses, it fails here instead of serving forever."""
    def refuse(*_, **__):
        raise AssertionError("the command started serving")

    monkeypatch.setattr("kvscope.backend.server.serve.serve_forever", refuse)
    monkeypatch.setattr("kvscope.backend.server.serve.serve_in_thread", refuse)


@pytest.mark.parametrize("flag,value", [("--port", "99999"), ("--port", "0"), ("--ui-port", "http")])
def test_ports_outside_1_to_65535_are_refused_by_the_parser(capsys, never_serves, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip() == (
        f"kvscope serve: argument {flag}: '{value}' is not a port number (1-65535) (see kvscope serve --help)")


@pytest.mark.parametrize("argv", [[], ["run"], ["serve", "--bogus"], ["generate", "--max-tokens", "many"],
                                  ["export", "t.jsonl", "--out", "x.png", "--step", "1.5"]])
def test_a_bad_command_line_is_one_line_naming_what_is_wrong_and_help_still_has_the_usage(capsys, never_serves,
                                                                                        argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith("kvscope") and err.rstrip().endswith("--help)")
    with pytest.raises(SystemExit) as help_:
        main([*argv[:1], "--help"])
    assert help_.value.code == 0 and capsys.readouterr().out.startswith("usage: kvscope")


@pytest.fixture
def busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


@pytest.mark.parametrize("ui", [False, True])
def test_a_busy_port_names_the_flag_that_chose_it(capsys, never_serves, busy_port, ui):
    argv = ["serve", "--port", str(busy_port), "--ui-port", str(free_port())] + ([] if ui else ["--no-ui"])
    code, out, err = run_cli(capsys, *argv)
    assert one_line_error(code, err).startswith(f"kvscope serve: --port {busy_port}: in use")
    assert not out  # no address printed for a server that does not listen
    code, out, err = run_cli(capsys, "serve", "--port", str(free_port()), "--ui-port", str(busy_port))
    assert one_line_error(code, err).startswith(f"kvscope serve: --ui-port {busy_port}: in use") and not out


def test_a_model_that_cannot_load_fails_at_start(capsys, never_serves, tmp_path):
    code, out, err = run_cli(capsys, "serve", "--no-ui", "--port", str(free_port()), "--model", str(tmp_path))
    # what it tried to load, then one line saying why it could not
    assert "config.json" in one_line_error(code, err) and out == f"loading {tmp_path} (weights: native) ...\n"


# ---- POST /api/runs: a 4xx naming the cause, and a line in the log ---------------------------------------


@pytest.fixture
def client():
    manager = RunManager()
    with in_process(manager) as c:  # a loopback Host (guards.py)
        yield c


def test_run_start_failures_are_4xx_naming_the_cause_and_logged(client, monkeypatch, caplog):
    def refuse(*_, **__):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvscope.backend.server.engine_run.ScenarioRun", refuse)
    with caplog.at_level(logging.WARNING, logger="kvscope.backend.server.app"):
        r = client.post("/api/runs", json={"scenario": "shared-prefix"})
    assert r.status_code == 400
    assert r.json()["error"] == "the run could not start: OSError: [Errno 28] No space left on device"
    record = next(r for r in caplog.records if r.name == "kvscope.backend.server.app")
    assert "No space left on device" in record.getMessage() and record.exc_info  # the cause's traceback, logged


@pytest.mark.parametrize("overrides,needle", [
    ({"model": "no-such-model"}, "model: 'no-such-model' is not a model this server offers"),
    ({"engine.max_num_seq": 4}, "overrides engine.max_num_seq=4: unknown field; did you mean engine.max_num_seqs?"),
    ({"engine.num_blocks": None, "engine.kv_cache_memory_mb": 1e9}, "engine.kv_cache_memory_mb: this run's KV cache "
                                                                     "would take 1000000000.0 MB"),  # a petabyte
])
def test_real_run_start_failures_are_4xx(client, overrides, needle):
    r = client.post("/api/runs", json={"scenario": "shared-prefix", "overrides": overrides})
    assert 400 <= r.status_code < 500 and needle in r.json()["error"] and r.json()["error"]


def test_the_dashboard_client_gets_the_reason_to_show(monkeypatch):
    from kvscope.frontend.client import Backend, BackendError

    manager = RunManager()
    with live_server(manager) as url:
        with pytest.raises(BackendError, match="did you mean engine.block_size"):
            asyncio.run(Backend(url).start_run("shared-prefix", {"engine.block_sise": 8}))


def test_a_reader_that_leaves_early_is_no_error():
    """`kvscope scenarios | head -1`: the pipe closes under the command, which ends quietly, as SIGPIPE would."""
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "scenarios"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""
