"""The sandbox's containment, one test per property, on every backend that is installed (bwrap is
skipped where it is not; the unshare fallback must work), and the code-execution reward.

Each test has a positive control or a bound, so that it fails when the property breaks rather
than passing because the probe itself broke."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from hybridflow.agent.sandbox import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable, core, run_python
from hybridflow.rewards.code import code_case_results, code_score, extract_code, parse_test_cases
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


@pytest.mark.parametrize("status", [152, 137, 129])
def test_exit_status_is_reported_as_it_was_not_as_a_signal(sb, status):
    # 152 = 128 + SIGXCPU, 137 = 128 + SIGKILL: a shell init reported these as "killed by the limit"
    res = py(sb, f"import sys; sys.exit({status})")
    assert (res.exit_code, res.killed_reason, res.timed_out) == (status, None, False)
    killed = py(sb, "import os, signal; os.kill(os.getpid(), signal.SIGXCPU)")  # control: a real signal
    assert (killed.exit_code, killed.killed_reason) == (-24, "cpu time limit")


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
print(sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]))  # the netns's interfaces
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
    # stopped at its 2 s wall (or sooner by CPU); the slack covers teardown of 8 spinning processes on 2
    # shared cores while other CI tests run (3.77 s was seen with the unshare backend)
    assert res.exit_code != 0 and res.wall_s < 5.0
    assert host_processes_with(marker) == []


def test_infinite_loop_hits_the_cpu_limit(sb):
    res = py(sb, "while True:\n    pass\n", SandboxLimits(cpu_s=1, wall_s=8))
    assert (res.killed_reason, res.timed_out, res.exit_code) == ("cpu time limit", False, -24)
    assert res.wall_s < 7


def test_sleeping_forever_hits_the_wall_limit(sb):
    # 3 s: under a loaded CI the interpreter's start alone once took over 1 s, before the print
    res = py(sb, "import time\nprint('start', flush=True)\ntime.sleep(60)\n", SandboxLimits(wall_s=3))
    assert res.timed_out and res.killed_reason == "wall time limit (3 s)" and not res.ok
    assert res.stdout == "start\n" and 3 <= res.wall_s < 4.5  # partial output is kept


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


# ------------------------------------------------------------------ limits for the whole sandbox
def whole_sandbox(sb: Sandbox, res: SandboxResult) -> None:
    """Skip (saying so) where this machine gave the sandbox no cgroup; the result must then say so too."""
    if sb.enforcement.cgroup is None:
        assert res.enforcement.cgroup is None and "per process only" in res.enforcement.weaker()[0]
        pytest.skip(f"no cgroup here, and the result reports it: {res.enforcement.weaker()[0]}")


def host_shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def test_memfds_count_against_the_memory_limit(sb):
    # 64 memfds of 16 MiB (1 GiB), each under file_size_mb: RLIMIT_AS never sees these pages.
    code = """
import os
fds = []
for i in range(64):
    fd = os.memfd_create(f"m{i}")
    os.write(fd, b"x" * (16 << 20))
    fds.append(fd)
    print(i + 1, flush=True)
print("held 1 GiB")
"""
    before = host_shmem_kib()
    res = py(sb, code, SandboxLimits(memory_mb=256, file_size_mb=32, wall_s=20, cpu_s=10))
    whole_sandbox(sb, res)
    held_mib = 16 * max([int(w) for w in res.stdout.split() if w.isdigit()] or [0])
    assert "held 1 GiB" not in res.stdout and 64 <= held_mib <= 256 + 32, res  # it got going, then was stopped
    assert res.killed_reason and "memory limit" in res.killed_reason and not res.ok
    assert host_shmem_kib() - before < 64 << 10  # nothing stayed behind on the host


def test_memory_limit_holds_across_processes(sb):
    code = """
import os, time
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        a = bytearray(200 << 20)  # each under the per-process limit of 256 MiB
        print("child", i, flush=True)
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
ok = sum(os.waitpid(p, 0)[1] == 0 for p in kids)
print("children ok", ok)
"""
    res = py(sb, code, SandboxLimits(memory_mb=256, wall_s=20, cpu_s=10))
    whole_sandbox(sb, res)
    assert res.stdout.count("child") >= 1  # control: one 200 MiB child fits
    assert "children ok 4" not in res.stdout and res.peak_memory_mb <= 256 + 32
    assert res.killed_reason and "memory limit" in res.killed_reason and not res.ok


def test_cpu_limit_is_summed_over_processes(sb):
    code = """
import os
for i in range(4):
    if os.fork() == 0:
        while True:
            pass
os.wait()
"""
    res = py(sb, code, SandboxLimits(cpu_s=1, wall_s=20))
    whole_sandbox(sb, res)
    # 4 children x their own RLIMIT_CPU of 1 s would be 4 s; the sum is stopped at 1 s + 0.5 s grace + a poll.
    assert res.killed_reason and res.killed_reason.startswith("cpu time limit"), res
    assert 1.0 <= res.cpu_s < 2.2 and not res.timed_out


# ------------------------------------------------------------------ what the kernel does not namespace
KEYCTL = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS = {"x86_64": (248, 250), "aarch64": (217, 219)}[__import__("os").uname().machine]  # add_key, keyctl
def add_key(desc, payload, ring):
    n = libc.syscall(SYS[0], b"user", desc.encode(), payload, len(payload), ring)
    return n, ctypes.get_errno()
def read_key(serial):
    buf = ctypes.create_string_buffer(256)
    n = libc.syscall(SYS[1], 11, serial, buf, 256)  # KEYCTL_READ
    return (buf.raw[:n] if n >= 0 else None), ctypes.get_errno()
"""


def test_keyrings_are_out_of_reach(sb):
    ns: dict = {}
    exec(KEYCTL, ns)
    secret = f"s3cret-{uuid.uuid4().hex}".encode()
    serial, err = ns["add_key"](f"hf-test-{uuid.uuid4().hex}", secret, -3)  # the host's session keyring
    if serial < 0:
        pytest.skip(f"this host cannot add a key (errno {err})")
    assert ns["read_key"](serial)[0] == secret  # control: the host reads it back
    planted = f"hf-planted-{uuid.uuid4().hex}"
    code = KEYCTL + f"""
print(read_key({serial}))
print(add_key({planted!r}, b"x", -3), add_key({planted!r}, b"x", -4))  # session, user keyring
"""
    res = py(sb, code)
    assert res.ok, res.stderr
    read, plant = res.stdout.splitlines()
    assert secret.decode() not in res.stdout and read.startswith("(None, ")
    assert plant == "(-1, 1) (-1, 1)"  # EPERM both: nothing is left behind for the next run
    search = py(sb, KEYCTL + f"print(libc.syscall(SYS[1], 10, -4, b'user', {planted!r}.encode(), 0))")  # KEYCTL_SEARCH
    assert search.ok and search.stdout == "-1\n"


def test_no_nested_namespaces_ptrace_or_mounts(sb):
    code = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def call(f, *a):
    return f(*a), ctypes.get_errno()
print(call(libc.unshare, 0x10000000))                      # CLONE_NEWUSER
print(call(libc.unshare, 0x00020000))                      # CLONE_NEWNS
print(call(libc.ptrace, 16, 1, None, None))                # PTRACE_ATTACH to the sandbox's init
print(subprocess.run(["unshare", "-U", "-r", "true"], capture_output=True).returncode)
pid = os.fork()                                            # control: a plain fork works
if pid == 0:
    os._exit(7)
print(os.waitpid(pid, 0)[1] >> 8)
"""
    res = py(sb, code)
    assert res.ok, res.stderr
    userns, mountns, ptrace, tool, forked = res.stdout.splitlines()
    assert (userns, mountns, ptrace) == ("(-1, 1)", "(-1, 1)", "(-1, 1)")
    assert tool != "0" and forked == "7"
    assert res.enforcement.seccomp and res.enforcement.keyring


# Socket families by raw syscall (the family is a full 64-bit register, as a hostile program may set it).
SOCKET_PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SOCKET, SOCKETPAIR = {"x86_64": (41, 53), "aarch64": (198, 199)}[os.uname().machine]
STREAM, RAW, SEQPACKET = 1, 3, 5
def socket(family, kind, proto=0):
    fd = libc.syscall(ctypes.c_long(SOCKET), ctypes.c_ulong(family), ctypes.c_long(kind), ctypes.c_long(proto))
    err = ctypes.get_errno()
    if fd >= 0:
        os.close(fd)
    return 0 if fd >= 0 else err
def socketpair(family, kind):
    fds = (ctypes.c_int * 2)()
    ok = libc.syscall(ctypes.c_long(SOCKETPAIR), ctypes.c_ulong(family), ctypes.c_long(kind), ctypes.c_long(0), fds) == 0
    err = ctypes.get_errno()
    if ok:
        os.close(fds[0]), os.close(fds[1])
    return 0 if ok else err
print(json.dumps({  # name -> 0 (opened) or the errno
    "AF_UNIX": socket(1, STREAM), "AF_INET": socket(2, STREAM), "AF_INET6": socket(10, STREAM),
    "socketpair AF_UNIX": socketpair(1, STREAM),
    "AF_VSOCK": socket(40, STREAM), "AF_PACKET": socket(17, RAW), "AF_NETLINK": socket(16, RAW, 0), "AF_ALG": socket(38, SEQPACKET),
    "(1 << 32) | AF_VSOCK": socket((1 << 32) | 40, STREAM), "(1 << 32) | AF_NETLINK": socket((1 << 32) | 16, RAW),
    "socketpair AF_INET": socketpair(2, STREAM), "socketpair (1 << 32) | AF_INET": socketpair((1 << 32) | 2, STREAM),
}))
"""
SOCKETS_ALLOWED = ["AF_UNIX", "AF_INET", "AF_INET6", "socketpair AF_UNIX"]
SOCKETS_DENIED = ["AF_VSOCK", "AF_PACKET", "AF_NETLINK", "AF_ALG", "(1 << 32) | AF_VSOCK", "(1 << 32) | AF_NETLINK",
                  "socketpair AF_INET", "socketpair (1 << 32) | AF_INET"]


def test_only_unix_and_ip_sockets_can_be_opened(sb):
    res = py(sb, SOCKET_PROBE)
    assert res.ok and res.enforcement.seccomp, res.stderr
    got = json.loads(res.stdout)
    assert {k: got[k] for k in SOCKETS_ALLOWED} == dict.fromkeys(SOCKETS_ALLOWED, 0)  # control: these open
    assert {k: got[k] for k in SOCKETS_DENIED} == dict.fromkeys(SOCKETS_DENIED, 1)  # EPERM, from the filter
    # Control: the same probe in the same sandbox without the filter gets no EPERM for these (it opens
    # them, or the kernel says the family or operation is not supported here): the EPERM above is the filter's.
    unfiltered = copy.copy(sb)
    unfiltered._bpf_hex = ""
    res = py(unfiltered, SOCKET_PROBE)
    assert res.ok and not res.enforcement.seccomp, res.stderr
    got = json.loads(res.stdout)
    probed = ["AF_NETLINK", "AF_ALG", "AF_VSOCK", "(1 << 32) | AF_VSOCK", "(1 << 32) | AF_NETLINK", "socketpair AF_INET",
              "socketpair (1 << 32) | AF_INET"]
    assert all(got[k] != 1 for k in probed), got
    assert got["AF_NETLINK"] == 0 and got["(1 << 32) | AF_NETLINK"] == 0  # the kernel truncates the family to an int
    assert got["socketpair (1 << 32) | AF_INET"] == got["socketpair AF_INET"] != 0  # EOPNOTSUPP, not EPERM
    # AF_PACKET needs CAP_NET_RAW over the network namespace, which the sandbox never has: its control is the host's.
    if os.geteuid() == 0:
        host = subprocess.run([sys.executable, "-c", SOCKET_PROBE], capture_output=True, text=True, timeout=60)
        assert json.loads(host.stdout)["AF_PACKET"] == 0, host


def test_name_resolution_and_loopback_work_under_the_socket_filter(sb):
    """What clients use (glibc's getaddrinfo, which asks NETLINK with AI_ADDRCONFIG and is refused it here;
    socket.create_connection; asyncio's socketpair) still works inside the sandbox."""
    code = """
import asyncio, socket
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
print(len(socket.getaddrinfo("127.0.0.1", port, type=socket.SOCK_STREAM, flags=socket.AI_ADDRCONFIG)) > 0)
socket.create_connection(("127.0.0.1", port), timeout=2).close()
print("connected")
print(asyncio.run(asyncio.sleep(0, "loop ok")))
try:
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)
except OSError as e:
    print(e.errno)
"""
    res = py(sb, code)
    assert res.ok, res.stderr
    assert res.stdout.split() == ["True", "connected", "loop", "ok", "1"]  # the last: NETLINK was refused (EPERM)


# ------------------------------------------------------------------ a black-box agent's view (openai_agent.sandboxed_command)
VIEW_PROBE = """import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        return type(e).__name__
print(json.dumps({"prefix": sys.prefix, "script": read(__file__).startswith("import json"), "answers": read(os.path.join(here, "answers.txt")),
                  "asked": [read(p) for p in json.loads(sys.stdin.read() or "[]")]}))
"""


@pytest.fixture
def shared_dir():
    """Directories `nobody` can read (pytest's tmp_path has 0700 parents), removed afterwards."""
    made = []

    def make(parent: str = "/var/tmp") -> str:
        made.append(tempfile.mkdtemp(prefix="hf-agent-view-", dir=parent))
        os.chmod(made[-1], 0o755)
        return made[-1]

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def agent_view(sb: Sandbox, command: str, paths: tuple[str, ...] = (), asked: list[str] | None = None) -> tuple[dict, dict]:
    """(what VIEW_PROBE sees run as a sandboxed agent command on sb's backend, what it sees run on the host)."""
    from hybridflow.agent.openai_agent import sandboxed_command

    argv, show = sandboxed_command(command, paths)
    res = Sandbox(backend=sb.backend, show=show).run(argv, QUICK, stdin=json.dumps(asked or []))
    assert res.ok, (res, show)
    host = subprocess.run(argv, input=json.dumps(asked or []), capture_output=True, text=True, timeout=60, check=True)
    return json.loads(res.stdout), json.loads(host.stdout)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)


def test_agent_command_sees_its_script_not_the_files_next_to_it(sb, shared_dir, monkeypatch):
    # `python run.py` at the root of a checkout that also holds the answers (a relative argument, as typed there)
    folder = shared_dir()
    write(os.path.join(folder, "run.py"), VIEW_PROBE)
    write(os.path.join(folder, "answers.txt"), "42")
    monkeypatch.chdir(folder)
    inside, host = agent_view(sb, f"{sb.python} run.py")
    assert host["script"] and host["answers"] == "42"  # control: outside the sandbox the probe reads them
    assert inside["script"] and inside["answers"] == "FileNotFoundError"


def test_agent_sandbox_paths_show_a_listed_directory(sb, shared_dir):
    folder, data = shared_dir(), shared_dir()
    write(os.path.join(folder, "run.py"), VIEW_PROBE)
    write(os.path.join(data, "lib.py"), "listed")
    command, asked = f"{sb.python} {folder}/run.py", [os.path.join(data, "lib.py")]
    inside, host = agent_view(sb, command, asked=asked)
    assert host["asked"] == ["listed"] and inside["asked"] == ["FileNotFoundError"]  # control: not shown unless listed
    inside, _ = agent_view(sb, command, paths=(data,), asked=asked)
    assert inside["asked"] == ["listed"] and inside["script"]


@pytest.mark.parametrize("where", ["/var/tmp", "/tmp"])
def test_agent_venv_reached_through_a_symlink_runs(sb, shared_dir, where):
    """A checkout whose `.venv` is a symbolic link to a venv elsewhere (under the host's /tmp too, which the
    sandbox's own /tmp covers): the link is kept and its target shown, so the venv's interpreter, its
    pyvenv.cfg and its base Python resolve inside as outside."""
    venv = os.path.join(shared_dir(where), "venv")
    subprocess.run([sb.python, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    checkout = shared_dir()
    os.symlink(venv, os.path.join(checkout, ".venv"))
    write(os.path.join(checkout, "run.py"), VIEW_PROBE)
    inside, host = agent_view(sb, f"{checkout}/.venv/bin/python {checkout}/run.py")
    assert host["prefix"] == os.path.join(checkout, ".venv")  # control: the host runs it in the venv
    assert inside == host


def test_file_names_cannot_inject_commands(sb, monkeypatch):
    probe = f"hf-pwned-{uuid.uuid4().hex}"
    evil = f"$(touch {probe})"  # relative: the unshare setup script runs as host root in /
    with pytest.raises(ValueError, match="plain names"):
        sb.run_python("print(1)", files={evil: "x"})
    # And inert should a name ever get past the check: it is quoted wherever it reaches a shell.
    monkeypatch.setattr(core, "_FILE_NAME", re.compile(r"[^/]+"))
    res = sb.run_python("import os; print(sorted(os.listdir('.')))", files={"a b;`x`": "x", evil: "y"})
    assert not os.path.exists(f"/{probe}") and not os.path.exists(probe)
    assert res.ok and ast.literal_eval(res.stdout) == sorted(["a b;`x`", evil, "main.py"])


def test_weaker_limits_are_reported_not_silent(tmp_path, caplog):
    # A v1-shaped root that is not a cgroup file system (what a read-only or foreign path looks like).
    for c in ("memory", "pids", "cpuacct"):
        (tmp_path / c).mkdir()
    sb = Sandbox(backend="unshare", cgroup=str(tmp_path))
    assert sb.enforcement.cgroup is None and str(tmp_path) in sb.enforcement.why
    res = py(sb, "print(1)")
    assert res.ok and not res.enforcement.full and res.cpu_s is None
    assert res.enforcement.weaker() == [f"memory, process and CPU limits per process only (no cgroup: {sb.enforcement.why})"]
    off = Sandbox(backend="unshare", cgroup="none")
    assert off.enforcement.cgroup is None and "disabled" in off.enforcement.why


def test_a_read_only_cgroup_root_falls_back_and_says_so(tmp_path):
    """The machine without cgroup write access, simulated: the real v1 hierarchies bound read-only
    in a private mount namespace; a run there reports per-process limits."""
    if os.geteuid() != 0 or not all(os.path.isdir(f"/sys/fs/cgroup/{c}") for c in ("memory", "pids", "cpuacct")):
        pytest.skip("needs root and cgroup v1 hierarchies to bind read-only")
    root = tmp_path / "ro-cgroup"
    mounts = "; ".join(f"mkdir -p {root}/{c} && mount --bind -o ro /sys/fs/cgroup/{c} {root}/{c}"
                       for c in ("memory", "pids", "cpuacct"))
    check = ("from hybridflow.agent.sandbox import Sandbox; sb = Sandbox(backend='unshare'); "
             "r = sb.run_python('print(6 * 7)'); print(r.stdout.strip(), r.enforcement.cgroup, r.enforcement.weaker())")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mounts}; exec \"$0\" -c \"$1\"",
                          sys.executable, check], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HYBRIDFLOW_SANDBOX_CGROUP": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("42 None ['memory, process and CPU limits per process only (no cgroup: ")
    assert "Read-only file system" in out.stdout and "limits hold per process only" in out.stderr


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

    def score(solution, gt):
        return compute_score("code", solution, gt)["score"]

    assert compute_score("code", SOLUTION, json.dumps({"inputs": ["1", "7"], "outputs": ["2\n", "14  \n\n"]})) == \
        {"score": 1.0, "code_inprocess_checks": 0.0}
    fn = "```python\ndef add(a, b):\n    return a + b\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"]
    assert score(fn, asserts) == pytest.approx(2 / 3)
    assert score("```python\nwhile True: pass\n```", io[:1]) == 0.0  # a hang scores 0
    assert score("```python\nimport sys; print(4); sys.exit(1)\n```", io[:1]) == 0.0  # so does a crash
    assert score("```python\ndef add(a, b):\n    return 1 / 0\n```", asserts) == 0.0
    assert parse_test_cases("assert f() == 1")[0].check == "assert f() == 1"
    with pytest.raises(ValueError, match="fn_name"):
        parse_test_cases({"inputs": [[1]], "outputs": [2], "fn_name": "f(x)"})
    with pytest.raises(ValueError, match="same non-zero length"):
        parse_test_cases({"inputs": [[1]], "outputs": [2, 3], "fn_name": "f"})


WRONG_ADD = "def add(a, b):\n    return a - b\n"
RIGHT_ADD = "def add(a, b):\n    return a + b\n"
EXITS = {
    "SystemExit": "raise SystemExit(0)\n",
    "sys.exit": "import sys\nsys.exit(0)\n",
    "os._exit": "import os\nos._exit(0)\n",
    "atexit": "import atexit, os\natexit.register(os._exit, 0)\n",
    "exit-in-call": None,  # add() itself ends the process
    "forged-verdict": "print('0' * 32 + ' [{\"case\": 0, \"ok\": true}, {\"case\": 1, \"ok\": true}]')\n",
}


@pytest.mark.parametrize("trick", list(EXITS))
def test_code_reward_cannot_be_passed_by_exiting(sb, monkeypatch, trick):
    monkeypatch.setattr(core, "_DEFAULT", sb)  # the reward's sandbox is this backend
    checks = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    if EXITS[trick] is None:
        wrong = "import os\ndef add(a, b):\n    os._exit(0)\n"
        right = "import os, atexit\natexit.register(os._exit, 0)\n" + RIGHT_ADD
    else:
        wrong, right = WRONG_ADD + EXITS[trick], RIGHT_ADD + EXITS[trick]
    assert code_score(wrong, checks) == 0.0
    assert code_score(right, checks) == 1.0  # the controls without a trick are in test_code_reward_reports_each_case


def test_code_reward_reports_each_case(sb, monkeypatch):
    monkeypatch.setattr(core, "_DEFAULT", sb)
    half = "def add(a, b):\n    return a + b if a < 5 else 0\n"
    results = code_case_results(half, ["assert add(1, 2) == 3", "assert add(7, 1) == 8", "assert add(0, 0) == 0"])
    assert [r.passed for r in results] == [True, False, True]
    assert "assertion failed" in results[1].why
    assert code_score(WRONG_ADD, ["assert add(1, 2) == 3"]) == 0.0 and code_score(RIGHT_ADD, ["assert add(1, 2) == 3"]) == 1.0
    killer = "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    assert [r.passed for r in code_case_results(killer, ["assert add(1, 2) == 3"])] == [False]
