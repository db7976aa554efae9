"""`kvscope run`: scenario files validated, overrides applied, traces and reports written."""

import json

import pytest
import yaml

from kvscope.cli import main
from kvscope.backend.events.trace import read_trace
from kvscope.backend.scenario import SCENARIOS_DIR, ScenarioError, list_scenarios, load_scenario


def write_scenario(tmp_path, **changes):
    data = {"name": "tiny-run", "model": "demo", "engine": {"block_size": 4, "num_blocks": 64},
            "requests": [{"id": "a", "prompt": "ROMEO:\n", "max_tokens": 6, "sampling": {"temperature": 0}},
                         {"id": "b", "prompt_tokens": 20, "max_tokens": 4, "arrival_step": 2}]}
    data.update(changes)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_run_writes_trace_and_report_and_prints_the_table(tmp_path, capsys):
    path = write_scenario(tmp_path)
    trace, report = tmp_path / "t.jsonl", tmp_path / "r.json"
    code = main(["run", str(path), "--trace", str(trace), "--report", str(report), "--set", "engine.block_size=8"])
    out = capsys.readouterr().out
    assert code == 0 and "TTFT" in out and "prefix cache hit rate" in out
    events = read_trace(trace)  # validates every line against the schema
    assert events[0]["type"] == "header" and events[0]["config"]["block_size"] == 8
    assert events[-1]["type"] == "run_finished"
    summary = json.loads(report.read_text())
    assert summary["finished"] == 2 and summary["output_tokens"] == sum(
        len(e["output_token_ids"]) for e in events if e["type"] == "request_finished")


def test_the_table_reports_sharing_and_speculation(tmp_path, capsys):
    # The prompt repeats itself, so the n-gram lookup finds drafts (an empty lookup is a plain decode, not a verify).
    path = write_scenario(tmp_path, requests=[{"id": "a", "max_tokens": 8,
                                               "prompt": "ROMEO:\nWhat light through yonder window breaks? ROMEO:\nWhat light",
                                               "sampling": {"temperature": 0.5, "seed": 1, "n": 3}}],
                          engine={"block_size": 4, "num_blocks": 64,
                                  "speculative": {"method": "ngram", "num_tokens": 2}})
    report = tmp_path / "r.json"
    assert main(["run", str(path), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "KV blocks saved by sharing (peak)" in out and "tokens per verify" in out
    summary = json.loads(report.read_text())
    assert summary["peak_kv_blocks_saved_by_sharing"] >= 2  # two siblings borrow at least the prompt's first block
    assert summary["speculative"]["spec_tokens_per_verify"] >= 1


@pytest.mark.parametrize("changes,needle", [
    ({"engine": {"block_sise": 4}}, "engine.block_sise: unknown field; did you mean engine.block_size?"),
    ({"engine": {"block_size": 0}}, "engine.block_size: Input should be greater than or equal to 1"),
    ({"name": "Bad Name"}, "name: String should match pattern"),
    ({"requests": [{"id": "a", "max_tokens": 3}]}, "requests.0: give exactly one of prompt"),
    ({"requests": [{"id": "a", "prompt": "x", "sampling": {"top_p": -1}}]}, "requests.0.sampling.top_p"),
])
def test_bad_scenario_fields_exit_2_naming_the_field(tmp_path, capsys, changes, needle):
    code = main(["run", str(write_scenario(tmp_path, **changes))])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "s.yaml" in err and len(err.strip().splitlines()) == 1


def test_bad_override_and_unknown_names(tmp_path, capsys):
    assert main(["run", str(write_scenario(tmp_path)), "--set", "engine.batching=sideways"]) == 2
    assert "engine.batching" in capsys.readouterr().err
    assert main(["run", "../etc/passwd"]) == 2
    assert main(["run", "no-such-scenario"]) == 2
    assert "no such scenario" in capsys.readouterr().err


def test_every_shipped_scenario_is_valid_and_documented():
    scenarios = list_scenarios()
    assert len(scenarios) >= 4
    for s in scenarios:
        assert s.description and s.lesson, s.name
        assert (SCENARIOS_DIR / f"{s.name}.yaml").is_file()


def test_set_parses_values_as_yaml():
    s = load_scenario("shared-prefix", ["engine.prefix_caching=false", "engine.max_num_seqs=3", "seed=7"])
    assert s.engine.prefix_caching is False and s.engine.max_num_seqs == 3 and s.seed == 7
    with pytest.raises(ScenarioError, match="KEY=VALUE"):
        load_scenario("shared-prefix", ["engine.block_size"])


def test_schema_commands_print_json_schema(capsys):
    assert main(["schema", "scenario"]) == 0
    assert "engine" in json.loads(capsys.readouterr().out)["properties"]
    assert main(["schema", "events"]) == 0
    assert "iteration" in capsys.readouterr().out


def test_a_chat_scenario_prints_each_requests_reply_under_the_table(tmp_path, capsys):
    path = write_scenario(tmp_path, requests=[
        {"id": "hello", "messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 6,
         "sampling": {"temperature": 0}},
        {"id": "plain", "prompt": "ROMEO:\n", "max_tokens": 3}])
    report = tmp_path / "r.json"
    assert main(["run", str(path), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    reply = json.loads(report.read_text())["per_request"]["hello"]
    assert out.index("replies") > out.index("TTFT")
    assert f"  hello ({reply['finish_reason']}): {reply['output_text'].strip()!r}" in out.splitlines()
    assert "plain (" not in out  # a plain prompt is no chat: its text is in --report and the trace
