"""`miles reward` (score a jsonl file offline) and `miles bench reward`, called as functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.bench import rewards as bench
from miles.commands import reward as cli

USER = str(Path(__file__).parents[1] / "rewards" / "data" / "user_rewards.py")


def write_jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict], str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, [json.loads(line) for line in captured.out.splitlines()], captured.err


def test_scores_in_input_order_with_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"prompt": "1+1?", "response": "1+1=2 #### 2", "label": "2"},
        {"prompt": "half?", "response": "\\boxed{\\frac{1}{2}}", "label": "0.5", "data_source": "math"},
        {"prompt": "3*3?", "response": "#### 6", "label": "9"},
        {"response": "#### 7", "reward_model": {"ground_truth": "7"}},
    ]
    code, lines, _ = run_cli(
        ["--fn", "math", write_jsonl(tmp_path / "s.jsonl", rows), "--num-workers", "0"], capsys
    )
    assert code == 0
    assert [line["score"] for line in lines[:-1]] == [1.0, 1.0, 0.0, 1.0]
    summary = lines[-1]["summary"]
    assert summary["samples"] == 4 and summary["reward/mean"] == 0.75 and summary["reward/errors"] == 0.0


def test_failures_are_reported_per_line_and_exit_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"response": r, "label": "1"} for r in ("ok", "raise", "sleep", "nan")]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    code, lines, err = run_cli(
        ["--fn", f"{USER}:selective", path, "--timeout-s", "1", "--num-workers", "2"], capsys
    )
    assert code == 0
    assert lines[0] == {"score": 1.0}
    assert (
        lines[1]["score"] == 0.0
        and lines[1]["error"].startswith("ValueError")
        and lines[1]["error_kind"] == "exception"
    )
    assert lines[2]["error_kind"] == "timeout" and lines[3]["error_kind"] == "nan"
    assert lines[4]["summary"]["reward/errors"] == 3.0 and lines[4]["summary"]["reward/timeouts"] == 1.0
    assert "Traceback" in err  # the first traceback of a kind goes to the log (stderr)


def test_kwargs_and_verl_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"response": "42", "label": "42", "data_source": "gsm8k", "extra_info": {"bonus": 1.0}}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    code, lines, _ = run_cli(["--fn", f"{USER}:compute_score", path, "--num-workers", "0"], capsys)
    assert code == 0 and lines[0]["score"] == 2.25
    code, lines, _ = run_cli(
        ["--fn", "exact_match", path, "--kwargs", '{"case_sensitive": true}', "--num-workers", "0"], capsys
    )
    assert code == 0 and lines[0] == {"score": 1.0, "prediction": "42"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fn", "math", "/no/such/file.jsonl"], "does not exist"),
        (["--fn", "mathh", "{samples}"], "unknown reward 'mathh'"),
        (["--fn", f"{USER}:missing", "{samples}"], "has no 'missing'"),
        (["--fn", "math", "{samples}", "--kwargs", "{oops"], "--kwargs is not valid JSON"),
        (["--fn", "math", "{samples}", "--kwargs", "[1]"], "must be a JSON object"),
        (["--fn", "math", "{broken}"], "line 2 is not valid JSON"),
        (["--fn", "math", "{noresponse}"], "line 1: no 'response' field"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        "samples": write_jsonl(tmp_path / "ok.jsonl", [{"response": "#### 1", "label": "1"}]),
        "broken": str(tmp_path / "broken.jsonl"),
        "noresponse": write_jsonl(tmp_path / "nr.jsonl", [{"label": "1"}]),
    }
    (tmp_path / "broken.jsonl").write_text('{"response": "1", "label": "1"}\n{not json\n')
    code = cli.main([files.get(a.strip("{}"), a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_missing_required_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["samples.jsonl"]) == 2
    assert "--fn" in capsys.readouterr().err


def test_bench_prints_a_table_and_a_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--samples", "16", "--code-samples", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    record = json.loads(lines[-1])
    assert lines[0].split()[:2] == ["workload", "samples"]
    for name in ("math_numeric", "math_numeric_in_process", "math_latex", "code"):
        assert record[f"{name}_samples_per_s"] > 0
        assert record[f"{name}_errors"] == 0.0


def test_response_ids_come_from_the_rows_or_the_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reward = tmp_path / "length.py"
    reward.write_text("def length(sample):\n    return {'score': 1.0, 'tokens': len(sample.response_ids)}\n")
    fn = f"{reward}:length"
    with_ids = write_jsonl(
        tmp_path / "ids.jsonl", [{"response": "abc", "label": "x", "response_ids": [1, 2, 3, 4]}]
    )
    code, lines, err = run_cli(["--fn", fn, with_ids, "--num-workers", "0"], capsys)
    assert code == 0 and lines[0]["tokens"] == 4 and "warning" not in err

    without = write_jsonl(tmp_path / "text.jsonl", [{"response": "abc", "label": "x"}])
    code, lines, err = run_cli(["--fn", fn, without, "--num-workers", "0"], capsys)
    assert code == 0 and lines[0]["tokens"] == 0
    assert "1 of 1 samples have no response_ids" in err and "--tokenizer" in err

    code, lines, err = run_cli(
        ["--fn", fn, without, "--num-workers", "0", "--tokenizer", "init:qwen3_moe:tiny"], capsys
    )
    assert code == 0 and lines[0]["tokens"] == 3 and "warning" not in err  # the character tokenizer

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"response": "abc", "response_ids": "1 2"}])
    code, _, err = run_cli(["--fn", fn, bad], capsys)
    assert code == 2 and "list of token ids" in err
