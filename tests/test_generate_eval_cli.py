"""`miles generate` and `miles eval` on the shipped checkpoint, through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def miles(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_generate_from_jsonl_and_text(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Ann has 3 pens and gets 4 more. How many pens does Ann have now?"})
        + "\n"
        + json.dumps(
            {
                "prompt": [
                    {"role": "user", "content": "Ben has 9 cups and gives away 2. How many cups are left?"}
                ]
            }
        )
        + "\n"
    )
    out = miles(
        "generate",
        "--model",
        "builtin:tiny_moe_math",
        "--prompts",
        str(prompts),
        "-n",
        "2",
        "--temperature",
        "1.0",
        "--max-new-tokens",
        "24",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 4 and [r["index"] for r in rows] == [0, 1, 0, 1]
    assert all("####" in r["response"] or r["status"] == "truncated" for r in rows)

    text = tmp_path / "p.txt"
    text.write_text("Cat has 10 eggs and gets 5 more. How many eggs does Cat have now?\n")
    dest = tmp_path / "out.jsonl"
    out = miles(
        "generate",
        "--model",
        "builtin:tiny_moe_math",
        "--prompts",
        str(text),
        "--out",
        str(dest),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert len(dest.read_text().splitlines()) == 1


def test_generate_bad_input_is_clean(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    out = miles("generate", "--model", "builtin:tiny_moe_math", "--prompts", str(bad), cwd=tmp_path)
    assert out.returncode == 2 and "not valid JSON" in out.stderr and "Traceback" not in out.stderr
    out = miles("eval", "--model", "builtin:nope", cwd=tmp_path)
    assert out.returncode == 2 and "tiny_moe_math" in out.stderr


def test_eval_shipped_checkpoint_is_a_weak_start(tmp_path: Path) -> None:
    out = miles("eval", "--model", "builtin:tiny_moe_math", "--num", "200", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert 0.15 <= result["eval/accuracy"] <= 0.40  # the documented weak start (27% when shipped)
