"""The sandbox's containment, one test per property, on every backend that is installed (bwrap is
skipped where it is not; the unshare fallback must work), and the code-execution reward.

Each test has a positive control or a bound, so that it fails when the property breaks rather
than passing because the probe itself broke."""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import uuid

import pytest

from hybridflow.agent.sandbox import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from hybridflow.rewards.code import code_score, extract_code, parse_test_cases
from hybridflow.rewards.scorers import compute_score

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = SandboxLimits(cpu_s=2, wall_s=5)


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def sb(request) -> Sandbox:
    if request.param == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/bootstrap.sh installs it)")
    return Sandbox(backend=request.param)


def py(sb: Sandbox, code: str, limits: SandboxLimits = QUICK, **kw) -> SandboxResult:
    return sb.run_python(code, limits, **kw)


def marked(sb: Sandbox, code: str, marker: str, limits: SandboxLimits) -> SandboxResult:
    """Run ``code`` with ``marker`` on the command line (inherited by the processes it forks)."""
    return sb.run([sb.python, "-c", code, marker], limits)


def host_processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_runs_code_with_stdin_and_reports_exit_status(sb):
    res = py(sb, "import sys; print(sys.stdin.read().upper()); sys.exit(3)", stdin="hi")
    assert (res.stdout, res.exit_code, res.timed_out, res.killed_reason, res.ok) == ("HI\n", 3, False, None, False)
    assert py(sb, "print(6 * 7)").ok


def test_no_network(sb):
    server = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0hf-sandbox-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    try:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # control: the host reaches it
        code = f"""
import socket
def attempt(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(addr)
        return "connected"
    except OSError as e:
        return type(e).__name__
print(attempt(socket.AF_INET, ("127.0.0.1", {port})))
print(attempt(socket.AF_INET, ("1.1.1.1", 53)))
print(attempt(socket.AF_UNIX, {name!r}))
print([n for _, n in socket.if_nameindex()])
"""
        res = py(sb, code)
        assert res.ok, res.stderr
        local, internet, unix, interfaces = res.stdout.splitlines()
        assert "connected" not in (local, internet, unix), res.stdout
        assert interfaces == "['lo']"
    finally:
        server.close()
        abstract.close()


def test_only_the_private_tmp_is_writable(sb):
    probe = f"hf-sandbox-{uuid.uuid4().hex}"
    code = f"""
import os
denied = []
for path in ["/{probe}", "/usr/{probe}", "/etc/{probe}", "/dev/shm/{probe}", "/proc/{probe}", "/var/tmp/{probe}",
             "/home/{probe}", "/root/{probe}", {os.path.join(ROOT, probe)!r}]:
    try:
        open(path, "w").write("x")
    except OSError:
        denied.append(path)
open("{probe}", "w").write("mine")  # cwd is the private /tmp
print(len(denied), os.getcwd(), open("/tmp/{probe}").read())
"""
    res = py(sb, code)
    assert res.ok, res.stderr
    assert res.stdout.split() == ["9", "/tmp", "mine"]
    assert not os.path.exists(f"/tmp/{probe}") and not os.path.exists(os.path.join(ROOT, probe))  # nothing on the host


def test_host_files_are_not_readable(sb):
    secrets = [os.path.join(ROOT, "pyproject.toml"), os.path.abspath(__file__), "/root/.bashrc", "/etc/shadow", "/etc/hostname"]
    existing = [p for p in secrets if os.path.exists(p)]
    assert os.path.join(ROOT, "pyproject.toml") in existing
    code = f"""
import os
seen = []
for path in {existing!r}:
    try:
        open(path, "rb").read(1)
        seen.append(path)
    except OSError:
        pass
print(seen, sorted(os.listdir("/")))
"""
    res = py(sb, code)
    assert res.ok, res.stderr
    assert res.stdout.startswith("[] "), res.stdout
    assert not {"work", "root", "home", "opt", "var", "srv", "mnt"} & set(ast.literal_eval(res.stdout[3:]))


def test_host_environment_is_not_visible(sb, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_SANDBOX_TEST_SECRET", secret)
    code = """
import os
seen = [k for k, v in os.environ.items() if "HF_SANDBOX_TEST_SECRET" in k]
for pid in filter(str.isdigit, os.listdir("/proc")):  # the sandbox's init and helpers too
    try:
        seen += [pid] if b"HF_SANDBOX_TEST_SECRET" in open(f"/proc/{pid}/environ", "rb").read() else []
    except OSError:
        pass
print(seen, sorted(os.environ))
"""
    res = py(sb, code)
    assert res.ok, res.stderr
    assert secret not in res.stdout
    assert res.stdout.startswith("[] ") and "'PATH'" in res.stdout and "'HOME'" in res.stdout


def test_process_limit_stops_a_fork_bomb(sb):
    # Kernel-enforced: fork fails with EAGAIN at max_procs (the loop's cap of 200 is only the test's bound).
    code = """
import os, time
n = 0
try:
    while n < 200:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print("refused", n, e.errno)
"""
    res = py(sb, code, SandboxLimits(max_procs=8, wall_s=10))
    assert res.ok, res.stderr
    word, n, errno = res.stdout.split()
    assert word == "refused" and int(n) < 8 and int(errno) == 11
    assert res.wall_s < 5  # the sleeping children did not keep it alive
    # A real bomb: every process forks forever; it is stopped within the limits and nothing survives.
    marker = f"hf-bomb-{uuid.uuid4().hex}"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = marked(sb, bomb, marker, SandboxLimits(max_procs=8, cpu_s=1, wall_s=2))
    assert res.timed_out or res.killed_reason, res
    assert res.exit_code != 0 and res.wall_s < 3.5
    assert host_processes_with(marker) == []


def test_infinite_loop_hits_the_cpu_limit(sb):
    res = py(sb, "while True:\n    pass\n", SandboxLimits(cpu_s=1, wall_s=8))
    assert (res.killed_reason, res.timed_out, res.exit_code) == ("cpu time limit", False, -24)
    assert res.wall_s < 7


def test_sleeping_forever_hits_the_wall_limit(sb):
    res = py(sb, "import time\nprint('start', flush=True)\ntime.sleep(60)\n", SandboxLimits(wall_s=1))
    assert res.timed_out and res.killed_reason == "wall time limit (1 s)" and not res.ok
    assert res.stdout == "start\n" and 1 <= res.wall_s < 2.5  # partial output is kept


def test_memory_limit_stops_a_4gib_allocation(sb):
    code = "a = bytearray(64 << 20)\nprint('64 MiB ok', flush=True)\nb = bytearray(4 << 30)\nprint('4 GiB ok')\n"
    res = py(sb, code, SandboxLimits(memory_mb=256, wall_s=5))
    assert res.stdout == "64 MiB ok\n" and res.exit_code == 1 and "MemoryError" in res.stderr


def test_file_size_and_tmp_size_limits(sb):
    code = """
try:
    open("big", "wb").write(b"x" * (3 << 20))
except OSError as e:
    print("file", e.errno)
import os
os.remove("big")
try:
    for i in range(10):
        open(f"f{i}", "wb").write(b"x" * (1 << 20))
except OSError as e:
    print("tmp", e.errno)
"""
    res = py(sb, code, SandboxLimits(file_size_mb=2, tmp_mb=4, wall_s=5))
    assert res.ok, res.stderr
    assert res.stdout.split() == ["file", "27", "tmp", "28"]  # EFBIG, ENOSPC


def test_output_is_truncated_and_decoded(sb):
    res = py(sb, "import sys\nsys.stdout.write('a' * 5_000_000)\nsys.stderr.write('b' * 100_000)\n",
             SandboxLimits(output_bytes=1000, wall_s=5))
    assert res.ok and res.truncated
    assert res.stdout == "a" * 1000 and res.stderr == "b" * 1000
    res = py(sb, "import sys\nsys.stdout.buffer.write(b'ok\\xff\\xfe\\n')\n")
    assert res.stdout == "ok\ufffd\ufffd\n" and not res.truncated


@pytest.mark.parametrize("hang", [False, True], ids=["exits", "times-out"])
def test_nothing_is_left_running(sb, hang):
    marker = f"hf-left-{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}]
subprocess.Popen(sleeper, start_new_session=True, stdout=subprocess.DEVNULL)  # a daemon in its own session
if os.fork() == 0:  # and a double-forked one
    if os.fork() == 0:
        os.setsid()
        os.execv(sys.executable, sleeper)
    os._exit(0)
def mine():
    return [p for p in os.listdir("/proc") if p.isdigit() and {marker!r}.encode() in open(f"/proc/{{p}}/cmdline", "rb").read()]
deadline = time.monotonic() + 2.0  # both must have exec'd their sleeper (its command line holds the marker)
while len(mine()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
print(len(mine()), flush=True)
if {hang!r}:
    time.sleep(60)
"""
    res = py(sb, code, SandboxLimits(wall_s=5))
    assert res.stdout.split() == ["2"], res  # control: both were running
    assert res.timed_out == hang
    assert host_processes_with(marker) == []


def test_module_level_run_python_and_unavailable_backend(monkeypatch):
    assert run_python("print('hi')").stdout == "hi\n"
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        Sandbox()


# ------------------------------------------------------------------------------------ code reward
SOLUTION = "Let me double it.\n```python\nprint('draft')\n```\nFinal:\n```python\nn = int(input())\nprint(n * 2)\n```\n"


def test_extract_code():
    assert extract_code(SOLUTION) == "n = int(input())\nprint(n * 2)\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("print(2)") == "print(2)"


def test_code_reward_is_the_fraction_of_cases_passed():
    io = [{"input": "2\n", "output": "4\n"}, {"input": "3", "output": "6"}, {"input": "5", "output": "11"}]
    assert code_score(SOLUTION, io) == pytest.approx(2 / 3)
    assert compute_score("code", SOLUTION, json.dumps({"inputs": ["1", "7"], "outputs": ["2\n", "14  \n\n"]})) == 1.0
    fn = "```python\ndef add(a, b):\n    return a + b\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"]
    assert compute_score("code", fn, asserts) == pytest.approx(2 / 3)
    assert compute_score("code", "```python\nwhile True: pass\n```", io[:1]) == 0.0  # a hang scores 0
    assert compute_score("code", "```python\nimport sys; print(4); sys.exit(1)\n```", io[:1]) == 0.0  # so does a crash
    assert parse_test_cases("assert f() == 1")[0].check == "assert f() == 1"
    with pytest.raises(ValueError, match="fn_name"):
        parse_test_cases({"inputs": [[1]], "outputs": [2], "fn_name": "f"})
