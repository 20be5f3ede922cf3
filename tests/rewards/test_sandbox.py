"""The code sandbox against hostile programs (each contained, reported as a failure, the host unaffected), in both
isolation modes, and the `code` reward on stdin/stdout and assert tests."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles.config import RewardConfig
from miles.rewards import (
    ProgramCase,
    RewardRunner,
    SandboxLimits,
    code_reward,
    extract_program,
    run_in_sandbox,
    sandbox,
)
from miles.rewards.code_reward import outputs_match
from miles.rewards.sandbox import BOOT_SCRIPT, sandbox_isolation
from miles.sample import Sample

LIMITS = SandboxLimits(wall_time_s=1.5, cpu_time_s=1.0, memory_mb=512, max_processes=8, total_time_s=30)
MODES = ["auto", "process"]


def sandbox_processes() -> list[str]:
    """Processes this test process's sandboxes left behind (their command line names the boot script and our pid)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if BOOT_SCRIPT.encode() in cmdline and str(os.getpid()).encode() in cmdline:
            found.append(entry)
    return found


def processes_of_uid(uid: int) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in status.splitlines()):
            found.append(entry)
    return found


@pytest.fixture(scope="module")
def listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


@pytest.fixture(scope="module")
def secret_holder() -> tuple[str, subprocess.Popen]:
    """A host process whose environment holds a secret the sandbox must not be able to read."""
    secret = f"s3cret-{secrets.token_hex(6)}"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "MILES_TEST_SECRET": secret},
    )
    yield secret, holder
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("mode", MODES)
def test_hostile_programs_are_contained(
    mode: str,
    tmp_path: Path,
    listener: socket.socket,
    secret_holder: tuple[str, subprocess.Popen],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret, holder = secret_holder
    monkeypatch.setenv("MILES_TEST_SECRET", secret)  # in the host's own environment too
    escape_targets = [f"/tmp/miles-escape-{secrets.token_hex(4)}", str(tmp_path / "escaped.txt")]
    port = listener.getsockname()[1]
    programs = {
        "infinite_loop": "while True:\n    pass",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "allocate_10gb": "block = b'x' * (10 * 1024 ** 3)\nprint(len(block))",
        "write_world_writable_tmp": f"open({escape_targets[0]!r}, 'w').write('escaped')",
        "write_host_dir": f"open({escape_targets[1]!r}, 'w').write('escaped')",
        "remount_writable": (  # needs CAP_SYS_ADMIN, which no case has; then retries the write
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "assert libc.mount(None, b'/', None, 0x20 | 0x1000, None) == 0, 'remount refused'\n"
            f"open({escape_targets[0]!r}, 'w').write('escaped')"
        ),
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')",
        "read_secrets": (
            "import os\n"
            f"found = [k for k, v in os.environ.items() if {secret!r} in v]\n"
            f"for pid in ['1', '{os.getpid()}', '{holder.pid}', *[p for p in os.listdir('/proc') if p.isdigit()]]:\n"
            "    try:\n"
            f"        if {secret.encode()!r} in open(f'/proc/{{pid}}/environ', 'rb').read():\n"
            "            found.append(pid)\n"
            "    except OSError:\n"
            "        pass\n"
            "print('found', found)\n"
            "assert found, 'no secret reachable'\n"
        ),
    }
    run = run_in_sandbox([ProgramCase(code) for code in programs.values()], LIMITS, isolation=mode)
    assert run.error is None
    results = dict(zip(programs, run.cases))
    for name, result in results.items():
        assert not result.ok, f"{name} was not contained: {result}"
    assert results["infinite_loop"].timed_out or results["infinite_loop"].signal in (9, 24)
    assert results["fork_bomb"].timed_out or results["fork_bomb"].signal in (9, 24)
    assert "MemoryError" in results["allocate_10gb"].stderr
    assert "connected" not in results["network"].stdout
    assert "no secret reachable" in results["read_secrets"].stderr
    assert secret not in results["read_secrets"].stdout
    for target in escape_targets:
        assert not os.path.exists(target)
    with pytest.raises(TimeoutError):
        listener.accept()
    assert sandbox_processes() == []
    if run.isolation["uid"] != os.getuid():  # cases ran under a throw-away uid: nothing of it may survive
        assert processes_of_uid(run.isolation["uid"]) == []
    if run.isolation["mode"] == "namespaces":
        assert "Network is unreachable" in results["network"].stderr
        assert "Read-only file system" in results["write_world_writable_tmp"].stderr
    else:
        assert "sandbox: opening a network socket is not allowed" in results["network"].stderr


@pytest.mark.parametrize("mode", MODES)
def test_well_behaved_programs_run(mode: str) -> None:
    big_input = "".join(f"{i}\n" for i in range(200_000))
    cases = [
        ProgramCase("import sys\nprint(sum(int(x) for x in sys.stdin))", big_input),
        ProgramCase(
            "open('scratch.txt', 'w').write('hi')\nprint(open('scratch.txt').read(), sorted(__import__('os').environ))"
        ),
        ProgramCase("import os\nprint(os.listdir('.'))"),  # a fresh working directory per case
        ProgramCase("import sys\nsys.exit(3)"),
        ProgramCase("print('x' * 100, end='')\nprint('y' * 2_000_000)"),
        ProgramCase(
            "print(input())", "first line\n" + "z" * 3_000_000
        ),  # unread stdin beyond the pipe buffer
    ]
    run = run_in_sandbox(cases, SandboxLimits(max_output_bytes=1 << 20), isolation=mode)
    first, scratch, listing, exit3, chatty, unread = run.cases
    assert first.ok and first.stdout == f"{sum(range(200_000))}\n"
    assert scratch.ok and scratch.stdout.startswith("hi ['HOME', 'LANG'")
    assert "MILES" not in scratch.stdout
    assert listing.ok and listing.stdout.strip() in ("['main.py']", "[]")
    assert exit3.exit_code == 3 and not exit3.ok
    assert chatty.output_limit_exceeded and not chatty.ok
    assert unread.ok and unread.stdout == "first line\n"


def test_namespace_isolation_report() -> None:
    report = sandbox_isolation("namespaces")
    if "error" in report:
        pytest.skip(f"namespaces are not available here: {report['error']}")
    assert report["mode"] == "namespaces"
    assert report["network"].startswith("netns")


@pytest.mark.skipif(
    os.getuid() != 0, reason="the failure is staged in the root-only interpreter exposure step"
)
def test_a_failure_after_unshare_falls_back_to_process_isolation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if "error" in sandbox_isolation("namespaces"):
        pytest.skip("namespaces are not available here")
    closed = Path(
        tempfile.mkdtemp(prefix="miles-closed-", dir="/tmp")
    )  # mode 700: the sandbox uid cannot read it
    original = sandbox._interpreter_paths
    monkeypatch.setattr(sandbox, "_interpreter_paths", lambda: [*original(), str(closed)])
    try:
        run = run_in_sandbox([ProgramCase("print(6 * 7)")], LIMITS)
        assert run.cases[0].ok and run.cases[0].stdout == "42\n"
        assert run.isolation["mode"] == "process"
        assert run.isolation["notes"][0].startswith("namespace setup failed")
        assert sandbox.NAMESPACES_BROKEN.is_set()
        assert run_in_sandbox([ProgramCase("print(1)")], LIMITS).isolation["mode"] == "process"  # remembered
    finally:
        sandbox.NAMESPACES_BROKEN.clear()
        closed.rmdir()


def test_total_time_budget_skips_remaining_cases() -> None:
    cases = [ProgramCase("while True: pass")] * 3
    run = run_in_sandbox(cases, SandboxLimits(wall_time_s=1, cpu_time_s=1, total_time_s=1.5))
    assert run.cases[0].timed_out or run.cases[0].signal is not None
    assert run.cases[2].error is not None and "budget" in run.cases[2].error


STDIN_LABEL = {"inputs": ["1 2\n", "10 20\n", "3 4\n"], "outputs": ["3\n", "30\n", "7\n"]}


@pytest.mark.parametrize(
    ("response", "label", "score"),
    [
        ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", STDIN_LABEL, 1.0),
        (
            "Sure:\n```py\na, b = map(int, input().split())\nprint(a + b if a < 10 else 0)\n```",
            STDIN_LABEL,
            2 / 3,
        ),
        ("a, b = map(int, input().split())\nprint(a * b)", json.dumps(STDIN_LABEL), 0.0),
        ("```python\nwhile True: pass\n```", STDIN_LABEL, 0.0),
        (
            "```python\ndef sq(x):\n    return x * x\n```",
            {"asserts": ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(-1) == 2"]},
            2 / 3,
        ),
        ("```python\nimport os\nos._exit(0)\n```", {"asserts": ["assert sq(2) == 4"]}, 0.0),
        ("```python\nimport sys\nsys.exit(0)\n```", {"test_list": ["assert sq(2) == 4"]}, 0.0),
        ("```python\nprint(float(input()) / 3)\n```", {"inputs": ["1"], "outputs": ["0.3333333333"]}, 1.0),
    ],
)
def test_code_reward(response: str, label: object, score: float) -> None:
    result = code_reward(Sample(response_text=response, label=label), case_timeout_s=1.0)
    assert result["score"] == pytest.approx(score)
    assert bool(result["first_failure"]) == (score < 1.0)


def test_code_reward_through_the_runner() -> None:
    batch = [
        Sample(
            response_text="```python\nprint(int(input()) * 2)\n```", label={"inputs": ["4"], "outputs": ["8"]}
        ),
        Sample(response_text="```python\nprint(1)\n```", label={"inputs": ["4"], "outputs": ["8"]}),
        Sample(response_text="```python\nprint(1)\n```", label={"fn_name": "f", "inputs": [], "outputs": []}),
    ]
    with RewardRunner(RewardConfig(fn="code", num_workers=2, timeout_s=20)) as runner:
        metrics = runner.score(batch)
    assert [s.reward for s in batch] == [1.0, 0.0, 0.0]
    assert batch[1].reward_info["first_failure"] == "case 0: expected '8', got '1'"
    assert "fn_name" in batch[2].reward_info["error"]
    assert metrics["reward/errors"] == 1.0


def test_extract_program_and_compare() -> None:
    assert extract_program("text\n```python\nA\n```\nmore\n```python\nB\n```") == "B\n"
    assert extract_program("```bash\nls\n```\n```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```python\nprint(2)\n") == "print(2)\n"  # truncated response
    assert extract_program("print(3)") == "print(3)"
    assert outputs_match("1 2\n3  \n\n", "1 2\n3")
    assert outputs_match("0.3333333", "0.33333333")
    assert not outputs_match("0.33", "0.3333333")
    assert not outputs_match("1 2", "1 2 3")


def test_extract_program_prefers_python_blocks_over_a_later_unlabeled_one() -> None:
    response = "Solution:\n```python\nn = int(input())\nprint(n * 2)\n```\nExample:\n```\n4\n```\n"
    assert extract_program(response) == "n = int(input())\nprint(n * 2)\n"
    assert extract_program("```\n4\n```\n```py\nprint(5)\n```\n```\nout\n```") == "print(5)\n"
    assert (
        extract_program("```\nprint(1)\n```\n```\nprint(2)\n```") == "print(2)\n"
    )  # none labeled: last unlabeled
    assert (
        extract_program("```\nprint(1)\n```\n```bash\nls\n```") == "print(1)\n"
    )  # unlabeled before other langs


def test_process_isolation_refuses_dir_fd_sqlite_and_signal_escapes(tmp_path: Path) -> None:
    """The audit-hook fallback: writes relative to a dir_fd or through sqlite, and signals to other processes."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    target = tmp_path / "escaped"
    escapes = {
        "dir_fd_open": f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.write(os.open('escaped', os.O_WRONLY | os.O_CREAT, dir_fd=d), b'x')",
        "dir_fd_mkfifo": f"import os\nos.mkfifo('escaped', dir_fd=os.open({str(tmp_path)!r}, os.O_RDONLY))",
        "rename_out": f"import os\nopen('f', 'w').write('x')\nos.rename('f', {str(target)!r})",
        "sqlite_connect": f"import sqlite3\nsqlite3.connect({str(target)!r}).execute('create table t(x)')",
        "sqlite_uri": f"import sqlite3\nsqlite3.connect('file:{target}?mode=rwc', uri=True).execute('create table t(x)')",
        "sqlite_attach": f"import sqlite3\nsqlite3.connect(':memory:').execute(\"ATTACH DATABASE '{target}' AS a\")",
        "kill": f"import os\nos.kill({victim.pid}, 9)",
        "signal_everything": "import os\nos.kill(-1, 0)",  # signal 0: a regression must not kill the host
        "pidfd": f"import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9)",
    }
    allowed = {
        "own_files": "import os, sqlite3\nos.mkdir('d')\nd = os.open('d', os.O_RDONLY)\n"
        "os.close(os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=d))\n"
        "c = sqlite3.connect('db.sqlite')\nc.execute(\"ATTACH DATABASE 'other.db' AS o\")\nprint('ok')",
        "own_signals": "import os, signal, threading\nos.kill(os.getpid(), 0)\nos.killpg(0, 0)\n"
        "signal.pthread_kill(threading.main_thread().ident, 0)\nprint('ok')",
    }
    try:
        programs = {**escapes, **allowed}
        run = run_in_sandbox([ProgramCase(code) for code in programs.values()], LIMITS, isolation="process")
        results = dict(zip(programs, run.cases))
        for name in escapes:
            assert not results[name].ok, f"{name} was not refused: {results[name]}"
            assert "sandbox:" in results[name].stderr or "not authorized" in results[name].stderr, name
        for name in allowed:
            assert results[name].ok and results[name].stdout == "ok\n", results[name]
        assert victim.poll() is None  # still alive
        assert not target.exists()
    finally:
        victim.kill()
        victim.wait()


def test_process_isolation_refuses_metadata_changes_outside_its_folder(tmp_path: Path) -> None:
    """Extended attributes (set, remove) and metadata changes through a descriptor opened read-only outside the
    working directory are refused; the same calls on the case's own files work."""
    victim = tmp_path / "victim"
    victim.write_text("host file")
    os.setxattr(victim, "user.keep", b"1")
    mode = victim.stat().st_mode
    escapes = {
        "setxattr": f"import os\nos.setxattr({str(victim)!r}, 'user.evil', b'1')",
        "setxattr_trusted": f"import os\nos.setxattr({str(victim)!r}, 'trusted.evil', b'1')",
        "removexattr": f"import os\nos.removexattr({str(victim)!r}, 'user.keep')",
        "setxattr_fd": f"import os\nos.setxattr(os.open({str(victim)!r}, os.O_RDONLY), 'user.evil', b'1')",
        "fchmod": f"import os\nos.fchmod(os.open({str(victim)!r}, os.O_RDONLY), 0o777)",
        "chmod_fd": f"import os\nos.chmod(os.open({str(victim)!r}, os.O_RDONLY), 0o777)",
        "fchown": f"import os\nos.fchown(os.open({str(victim)!r}, os.O_RDONLY), 1234, 1234)",
        "futime": f"import os\nos.utime(os.open({str(victim)!r}, os.O_RDONLY), (0, 0))",
    }
    allowed = {
        "own_xattrs": "import os\nopen('f', 'w').close()\nos.setxattr('f', 'user.x', b'1')\n"
        "os.setxattr(os.open('f', os.O_RDONLY), 'user.y', b'2')\nos.removexattr('f', 'user.x')\n"
        "os.fchmod(os.open('f', os.O_RDONLY), 0o600)\nprint('ok')",
    }
    programs = {**escapes, **allowed}
    run = run_in_sandbox([ProgramCase(code) for code in programs.values()], LIMITS, isolation="process")
    results = dict(zip(programs, run.cases))
    for name in escapes:
        assert not results[name].ok, f"{name} was not refused: {results[name]}"
        assert "sandbox:" in results[name].stderr, name
    for name in allowed:
        assert results[name].ok and results[name].stdout == "ok\n", results[name]
    assert os.listxattr(victim) == ["user.keep"]
    assert victim.stat().st_mode == mode and victim.stat().st_mtime > 0
