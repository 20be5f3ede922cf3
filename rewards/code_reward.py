"""The `code` built-in: run the response's program in the sandbox against the sample's tests.

The label (a dict, or a JSON string of one) holds either stdin/stdout cases as in APPS / TACO,
`{"inputs": [...], "outputs": [...]}`, or assert statements run after the program, `{"asserts": [...]}` (MBPP's
`test_list` / `test_setup_code` are read too). Score = fraction of cases passed. Each case is a separate execution;
expected outputs never enter the sandbox. An assert case passes only if the program, then the assert, run to the
end (a marker printed after the assert): a program that exits early does not pass.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

from miles.rewards.sandbox import ProgramCase, SandboxLimits, run_in_sandbox
from miles.sample import Sample

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[^\n]*\n(.*)$", re.DOTALL | re.IGNORECASE)
PYTHON_LANGS = ("python", "python3", "py")


def extract_program(response: str) -> str:
    """The last ```python fenced block; only when none is labeled python, the last unlabeled one (an unlabeled
    fence after a python block is usually sample input or output, not the program); then the last block of any
    language; a truncated final fence is read to the end; without fences, the whole response."""
    blocks = _FENCE.findall(response)
    python_blocks = [code for lang, code in blocks if lang.lower() in PYTHON_LANGS]
    if python_blocks:
        return python_blocks[-1]
    unlabeled = [code for lang, code in blocks if not lang]
    if unlabeled:
        return unlabeled[-1]
    if blocks:
        return blocks[-1][1]
    unclosed = _OPEN_FENCE.search(response)
    return unclosed.group(1) if unclosed else response


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def outputs_match(actual: str, expected: str, float_tolerance: float = 1e-6) -> bool:
    """Equal line by line (trailing whitespace and blank lines ignored), or token by token with numbers equal
    within `float_tolerance` (relative or absolute)."""
    if [line.rstrip() for line in actual.strip().splitlines()] == [
        line.rstrip() for line in expected.strip().splitlines()
    ]:
        return True
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g == w:
            continue
        try:
            if not math.isclose(float(g), float(w), rel_tol=float_tolerance, abs_tol=float_tolerance):
                return False
        except ValueError:
            return False
    return True


def parse_tests(label: Any) -> dict[str, Any]:
    tests = json.loads(label) if isinstance(label, str) else label
    if not isinstance(tests, dict):
        raise ValueError(
            "the code reward needs a label like {'inputs': [...], 'outputs': [...]} or {'asserts': [...]}, got "
            f"{type(tests).__name__}"
        )
    if tests.get("fn_name"):
        raise ValueError("call-based tests (fn_name) are not supported; convert them to asserts")
    if "asserts" in tests or "test_list" in tests:
        return {
            "asserts": list(tests.get("asserts") or tests.get("test_list")),
            "setup": tests.get("test_setup_code", ""),
        }
    if "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError(
                f"{len(tests['inputs'])} inputs but {len(tests['outputs'])} outputs in the label"
            )
        return {
            "inputs": [_as_text(i) for i in tests["inputs"]],
            "outputs": [_as_text(o) for o in tests["outputs"]],
        }
    raise ValueError(f"the code label has neither inputs/outputs nor asserts (keys: {sorted(tests)})")


def _failure_note(index: int, result: Any, expected: str | None) -> str:
    if result.error:
        return f"case {index}: {result.error}"
    if result.timed_out:
        return f"case {index}: timed out"
    if result.output_limit_exceeded:
        return f"case {index}: printed too much"
    if result.exit_code != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [f"killed by signal {result.signal}"]
        return f"case {index}: exit {result.exit_code}: {tail[0][:200]}"
    if expected is not None:
        return f"case {index}: expected {expected.strip()[:80]!r}, got {result.stdout.strip()[:80]!r}"
    return f"case {index}: did not reach the end of the test"


def code_reward(
    sample: Sample,
    case_timeout_s: float = 2.0,
    total_timeout_s: float = 8.0,
    memory_mb: int = 512,
    max_cases: int | None = None,
    isolation: str = "auto",
    site_packages: bool = True,
    float_tolerance: float = 1e-6,
) -> dict[str, Any]:
    """Fraction of the label's test cases the response's program passes. Keep total_timeout_s (all cases of one
    sample) below reward.timeout_s."""
    tests = parse_tests(sample.label)
    program = extract_program(sample.response_text)
    if not program.strip():
        return {"score": 0.0, "passed": 0, "total": 0, "first_failure": "no program in the response"}
    expected: list[str | None]
    marker = ""
    if "asserts" in tests:
        marker = f"miles-passed-{secrets.token_hex(8)}"
        cases = [
            ProgramCase(f"{program}\n\n{tests['setup']}\n{test}\nprint({marker!r})")
            for test in tests["asserts"]
        ]
        expected = [None] * len(cases)
    else:
        cases = [ProgramCase(program, stdin) for stdin in tests["inputs"]]
        expected = list(tests["outputs"])
    if max_cases is not None:
        cases, expected = cases[:max_cases], expected[:max_cases]
    if not cases:
        raise ValueError("the code label holds no test cases")
    limits = SandboxLimits(
        wall_time_s=case_timeout_s,
        cpu_time_s=case_timeout_s,
        memory_mb=memory_mb,
        total_time_s=total_timeout_s,
    )
    run = run_in_sandbox(cases, limits, isolation=isolation, site_packages=site_packages)
    if run.error and not run.isolation:
        raise RuntimeError(f"the sandbox failed: {run.error}")
    passed, failures = 0, []
    for index, (result, want) in enumerate(zip(run.cases, expected)):
        if want is None:
            ok = result.ok and result.stdout.rstrip().endswith(marker)
        else:
            ok = result.ok and outputs_match(result.stdout, want, float_tolerance)
        passed += ok
        if not ok:
            failures.append(_failure_note(index, result, want))
    return {
        "score": passed / len(cases),
        "passed": passed,
        "total": len(cases),
        "first_failure": failures[0] if failures else "",
        "sandbox": run.isolation.get("mode", "unknown"),
    }
