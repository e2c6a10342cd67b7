"""Run untrusted code (a model's tool call, a code answer being graded) in a locked-down process.

Why: the code comes from a policy under training. It must not reach the network, read the project
or the host's secrets, write anywhere that outlives the call, or take the machine down (fork bomb,
endless loop, huge allocation, endless output). Python-level tricks (``exec`` with trimmed
builtins, audit hooks) are escapable, so containment is done by the kernel, with well-kept tools:

- **bubblewrap** (``bwrap``) when installed, else **util-linux** ``unshare`` (plus ``mount``,
  ``pivot_root``, ``setpriv``). Either way the code runs in fresh user, mount, pid, network, IPC,
  UTS and cgroup namespaces:
  - network: a new network namespace holds only a loopback of its own, so the host's services
    (even on 127.0.0.1) and the internet are unreachable;
  - filesystem: the root is an empty tmpfs, remounted read-only, that shows only ``/usr`` (and
    the ``/bin``, ``/lib*`` links or binds), a few ``/etc`` files the dynamic loader wants, a
    minimal ``/dev``, a ``/proc`` of the sandbox's own pid namespace, and the interpreter. The
    project checkout, ``/root``, ``/home``, the host's ``/tmp`` are simply not there (an allow-list,
    not a block-list: nothing new on the host can leak in). The only writable place is ``/tmp``,
    a size-capped tmpfs that is also the working directory; it vanishes with the namespace;
  - environment: rebuilt from scratch (PATH, HOME, TMPDIR, LANG, PYTHONDONTWRITEBYTECODE);
  - identity: the code never runs as the kernel's root. When the host process is root (as in our
    containers) the sandbox first drops to ``nobody`` (``setpriv``), then enters a user namespace
    of its own. That is what makes ``RLIMIT_NPROC`` bite: the kernel exempts uid 0 from it, and
    since Linux 5.14 it counts per user namespace, so each sandbox gets its own process budget
    (a fork bomb meets EAGAIN at ``max_procs``), not one shared with every ``nobody`` process.
    It also puts file permissions in the way should a mount ever leak.
- **Limits for the whole sandbox** come from a cgroup made for the run (``cgroup.py``): memory
  including tmpfs, memfd and shared-memory pages, processes, and CPU time summed over every
  process (the host kills the run when the sum passes ``cpu_s``). Per-process rlimits stay as a
  first line (``MemoryError`` for one huge allocation, ``SIGXCPU`` for one busy loop, file size,
  open files, no core files). Where no cgroup can be made, only the rlimits hold, and every
  result says so (``SandboxResult.enforcement``; a warning once per process).
- **System calls and keys**: the code runs under a seccomp filter (``seccomp.py``: no keyrings,
  ptrace, new namespaces, mounts, bpf, userfaultfd, sockets other than unix and IP, ...) in a fresh
  anonymous session keyring.
- **The init** of the pid namespace is a small program of ours (``init.py``, run by the system
  Python) that sets up the program's process, reaps orphans and reports the program's real wait
  status on a pipe only it holds: an ``exit(152)`` is reported as exit 152, not as "killed by
  signal 24" (a shell's ``$?`` cannot tell the two apart).
- **Wall time** is enforced here: at the deadline the cgroup (or, without one, the namespace's
  init) is SIGKILLed; the kernel kills every other process of the namespace when its init dies
  (even ones that called ``setsid``), and each wrapper reaps its child: nothing is left, not even
  a zombie. A ``timeout -s KILL`` wrapper is the backstop should this (host) process die first.
- **Output** is read incrementally with a selector and at most ``output_bytes`` per stream are
  kept (the rest is drained and dropped), then decoded as UTF-8 with ``errors="replace"``.

Interpreter: the system ``/usr/bin/python3`` when present, since ``/usr`` is in the view anyway and
nothing else of the host has to be shown. Not the project's venv python: its prefix is the
checkout's ``.venv`` and its site-packages carries an editable finder pointing at the project's
source, so running it would mean exposing the project (and torch & co. are not what graded code
needs). Without a system python, the host's base interpreter (``sys.base_prefix``, stdlib only)
is bound read-only at its own path (with bwrap as root it must be readable by ``nobody``, else
"auto" settles on unshare, which binds as root). Anything else: pass ``python=``.

    >>> run_python("print(6 * 7)").stdout
    '42\\n'
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from hybridflow.agent.sandbox.cgroup import CgroupRoot, CgroupUnavailable, RunCgroup, find_cgroup_root
from hybridflow.agent.sandbox.seccomp import SeccompUnavailable, filter_bpf

__all__ = ["Enforcement", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "default_sandbox", "run_python"]

log = logging.getLogger(__name__)

NOBODY = 65534  # the sandbox's uid/gid when the host is root (see the module docstring)
WORKDIR = "/tmp"  # the sandbox's only writable directory, and its cwd
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "TMPDIR": WORKDIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",  # for child interpreters the code starts; ours gets -B
}
# Files under /etc the dynamic loader and time functions read; nothing with secrets or host names.
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links into /usr on merged-/usr systems
_DEVICES = ("null", "zero", "full", "random", "urandom")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # what `files=` names may be
_INIT_SOURCE = (Path(__file__).with_name("init.py")).read_text()
_WRAPPER_MB = 32  # memory of our processes around the code (init, bwrap, ...) on top of memory_mb
_CPU_GRACE_S = 0.5  # the summed CPU limit fires at cpu_s + this: one busy process meets its own RLIMIT_CPU first
_POLL_S = 0.05  # how often the summed CPU time is read
_INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), "
                 "or util-linux (unshare, setpriv, mount, pivot_root) on a kernel that allows user namespaces "
                 "(sysctl user.max_user_namespaces > 0; on Debian/Ubuntu also kernel.unprivileged_userns_clone=1 and "
                 "kernel.apparmor_restrict_unprivileged_userns=0)")


class SandboxUnavailable(RuntimeError):
    """Neither bubblewrap nor a working ``unshare`` is available on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. With a cgroup (see :class:`Enforcement`), ``memory_mb`` (everything the run
    holds in memory: processes, ``/tmp`` files, shared memory; plus a fixed allowance for our own
    wrappers), ``max_procs`` and ``cpu_s`` (summed over processes) hold for the whole sandbox; each
    process also meets them as rlimits. ``tmp_mb`` caps everything written to ``/tmp``,
    ``open_files`` the descriptors of each process."""

    cpu_s: float = 5.0
    memory_mb: int = 512
    max_procs: int = 32
    file_size_mb: int = 16
    wall_s: float = 10.0
    output_bytes: int = 8192  # per stream
    tmp_mb: int = 64
    open_files: int = 256

    def __post_init__(self) -> None:
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a number > 0, got {value!r}")


LIMIT_FIELDS = ("cpu_s", "memory_mb", "max_procs", "file_size_mb", "wall_s", "output_bytes", "tmp_mb", "open_files")


@dataclass(frozen=True)
class Enforcement:
    """Which protections held for a run. ``cgroup`` "v1"/"v2": memory, processes and CPU limits
    hold for the whole sandbox; None: per process only (rlimits), ``why`` says why."""

    cgroup: str | None
    seccomp: bool
    keyring: bool  # the code ran in a fresh anonymous session keyring
    why: str = ""

    @property
    def full(self) -> bool:
        return self.cgroup is not None and self.seccomp and self.keyring

    def weaker(self) -> list[str]:
        """What this run had less of than the full promise (docs/agents.md, "Threat model")."""
        out = []
        if self.cgroup is None:
            out.append(f"memory, process and CPU limits per process only (no cgroup: {self.why or 'unavailable'})")
        if not self.seccomp:
            out.append("no seccomp filter")
        if not self.keyring:
            out.append("no fresh session keyring")
        return out


@dataclass(frozen=True)
class SandboxResult:
    """What a run did; ``stdout``/``stderr`` hold at most ``output_bytes`` each, decoded as UTF-8."""

    stdout: str
    stderr: str
    exit_code: int  # the program's exit status; -N when signal N ended it (like subprocess)
    timed_out: bool  # the wall-time limit stopped it
    killed_reason: str | None  # why the sandbox (not the program) ended it, e.g. "cpu time limit"
    wall_s: float
    truncated: bool = False  # some output went over output_bytes and was dropped
    enforcement: Enforcement | None = None
    cpu_s: float | None = None  # CPU time of all its processes, summed (with a cgroup)
    peak_memory_mb: float | None = None  # with a cgroup

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None


_KILL_REASONS = {
    signal.SIGXCPU: "cpu time limit",
    signal.SIGXFSZ: "file size limit",
    signal.SIGKILL: "killed (SIGKILL: cpu hard limit or out of memory)",
}


class Sandbox:
    """Runs commands in the sandbox. ``backend``: "auto" (bwrap, else unshare), "bwrap" or "unshare";
    the choice is checked once with a trial run and :class:`SandboxUnavailable` says what to install.
    ``cgroup``: where run cgroups are made (a v1 root or a v2 directory; "none" for rlimits only);
    by default ``$HYBRIDFLOW_SANDBOX_CGROUP``, else found (see ``cgroup.py``)."""

    def __init__(self, limits: SandboxLimits | None = None, backend: str = "auto", python: str | None = None,
                 cgroup: str | None = None, show: Sequence[str] = ()):
        self.limits = limits or SandboxLimits()
        self.python = python or _default_python()
        self._as_nobody = os.geteuid() == 0
        self._ro_paths, self._links = _visible_paths(self.python)
        # `show`: more host paths in the view, read-only at their own place (a black-box agent's program,
        # its environment and its files; see openai_agent.py). Absolute and existing; each path is shown as
        # itself (a file is a file, not its directory).
        self._tmp_paths, self._tmp_links = self._add_shown(show)
        # Host-side tools by absolute path: Popen looks names up in the sandbox's PATH, not ours.
        search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"])
        tools = ("timeout", "setpriv", "bwrap", "unshare", "mount", "pivot_root")
        self._tools = {t: shutil.which(t, path=search) for t in tools}
        if backend not in ("auto", "bwrap", "unshare"):
            raise ValueError(f"backend must be 'auto', 'bwrap' or 'unshare', got {backend!r}")
        self._cgroup, cgroup_why = _cgroup_root(cgroup)
        try:
            self._bpf_hex = filter_bpf().hex()
        except SeccompUnavailable as e:
            self._bpf_hex = ""
            _warn_once(f"sandbox: no seccomp filter: {e}")
        self.enforcement = Enforcement(self._cgroup and f"v{self._cgroup.version}", bool(self._bpf_hex), True, cgroup_why)
        if self._cgroup is None:
            _warn_once(f"sandbox: limits hold per process only: no cgroup ({cgroup_why})")
        failures = []
        for name in ("bwrap", "unshare") if backend == "auto" else (backend,):
            why = self._try(name)
            if why is None:
                self.backend = name
                break
            failures.append(f"{name}: {why}")
        else:
            raise SandboxUnavailable(f"no working sandbox ({'; '.join(failures)}): {_INSTALL_HINT}")

    def _add_shown(self, show: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """Put ``show`` in the view: each path's real location is bound, and every symbolic link met on
        the way there is made again at its own place with its own target, so a path reaches the same
        file inside as on the host (a checkout's ``.venv`` linking to a venv elsewhere: the program's
        path, its ``pyvenv.cfg`` and its site-packages resolve). Binding only real paths also keeps a
        link from being followed in the wrong root: bwrap resolves a source's absolute link inside the
        new root, and unshare's setup runs after its tmpfs hides the host's ``/tmp``. Paths already in
        the view are skipped, and links inside a bound directory are there already. Returns (paths,
        links) under the host's ``/tmp``: those are made inside the sandbox's own ``/tmp``, after it is
        mounted; the rest join ``_ro_paths`` and ``_links``."""
        binds: list[str] = []
        links: list[tuple[str, str]] = []
        for path in show:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise ValueError(f"sandbox paths to show must be absolute and exist, got {path!r}")
            real, hops = _resolve(path)
            if real in ("/", WORKDIR):  # the whole host, or the sandbox's own /tmp
                raise ValueError(f"sandbox paths to show must not be / or {WORKDIR} itself, got {path!r} (real path {real!r})")
            binds.append(real)
            links += hops
        tmp_paths: list[str] = []
        for real in dict.fromkeys(binds):
            if any(_within(real, p) for p in self._ro_paths) or any(p != real and _within(real, p) for p in binds):
                continue
            (tmp_paths if _within(real, WORKDIR) else self._ro_paths).append(real)
        tmp_links: list[tuple[str, str]] = []
        made = {link for link, _ in self._links}
        for link, target in dict.fromkeys(links):
            if link in made or any(_within(link, p) for p in self._ro_paths + tmp_paths):
                continue
            made.add(link)
            (tmp_links if _within(link, WORKDIR) else self._links).append((link, target))
        return tmp_paths, tmp_links

    # ------------------------------------------------------------------ running
    def run_python(self, code: str, limits: SandboxLimits | None = None, *, stdin: str | bytes = "",
                   files: Mapping[str, str | bytes] | None = None) -> SandboxResult:
        """Run ``code`` as ``/tmp/main.py`` with ``stdin``; ``files`` are put next to it."""
        files = {**(files or {}), "main.py": code}
        # -E -s: no PYTHON* variables, no user site; -B: no .pyc; -u: output written so far survives a kill.
        return self.run([self.python, "-E", "-s", "-B", "-u", "main.py"], limits, stdin=stdin, files=files)

    def run(self, argv: Sequence[str], limits: SandboxLimits | None = None, *, stdin: str | bytes = "",
            files: Mapping[str, str | bytes] | None = None, env: Mapping[str, str] | None = None,
            sockets: Mapping[str, str] | None = None) -> SandboxResult:
        """Run ``argv`` (paths as seen inside the sandbox) in ``/tmp``, holding ``files``. Files and
        stdin travel as in-memory files (memfd), so nothing is written on the host's disk. ``env``:
        variables added to the sandbox's own (PATH, HOME, ... stay the sandbox's); ``sockets``: {path inside: host Unix socket} bound in
        (the one way out of the network namespace, for what the caller serves on it)."""
        lim = limits or self.limits
        for inside, host in (sockets or {}).items():
            if not inside.startswith("/run/") or ".." in inside or not os.path.isabs(host):
                raise ValueError(f"sandbox sockets are bound under /run/ from an absolute host path, got {inside!r}: {host!r}")
        for name in files or {}:
            if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
                raise ValueError(f"sandbox file names are plain names in {WORKDIR} (letters, digits, '_', '-', '.'; "
                                 f"not starting with '.' or '-'), got {name!r}")
        fds: list[tuple[int, str]] = []
        cg: RunCgroup | None = None
        status_r, status_w = os.pipe()
        handed_over = False  # _execute closes the write end itself (right after the start): never twice
        try:
            for name, data in (files or {}).items():
                fds.append((_memfd(name, data), name))
            stdin_fd = _memfd("stdin", stdin)
            try:
                if self._cgroup is not None:
                    cg = self._cgroup.create(_mib(lim.memory_mb + _WRAPPER_MB), int(lim.max_procs))
                cmd = self._command(self.backend, lim, list(argv), fds, status_w, dict(env or {}), dict(sockets or {}))
                if cg is not None:
                    cmd = cg.join_prefix() + cmd
                handed_over = True
                return _execute(cmd, lim, stdin_fd, [fd for fd, _ in fds] + [status_w], status_r, status_w, cg,
                                self.enforcement)
            finally:
                os.close(stdin_fd)
                if cg is not None:
                    cg.remove()
        finally:
            for fd, _ in fds:
                os.close(fd)
            os.close(status_r)
            if not handed_over:
                os.close(status_w)

    # ------------------------------------------------------------------ command lines
    def _command(self, backend: str, lim: SandboxLimits, argv: list[str], files: list[tuple[int, str]],
                 status_fd: int, env: dict[str, str], sockets: dict[str, str]) -> list[str]:
        # Backstop: should this process die before it can enforce the wall time, `timeout` does.
        outer = [self._tools["timeout"], "-s", "KILL", f"{lim.wall_s + 5:g}"]
        if backend == "bwrap":
            # bwrap makes the user namespace (uid nobody when we are root: setpriv drops first).
            drop = [self._tools["setpriv"], f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if self._as_nobody else []
            init = self._init(lim, argv, status_fd, env, drop=None, userns=None)
            return [*outer, *drop, *self._bwrap(lim, files, sockets), "--", *init]
        # unshare: the init starts as root in the new namespaces (no user namespace yet), so it drops
        # to nobody and makes the program's user namespace itself.
        uid = {"uid": NOBODY, "gid": NOBODY}
        init = self._init(lim, argv, status_fd, env, drop=uid if self._as_nobody else None, userns=uid)
        return [*outer, *self._unshare(lim, files, sockets, init, status_fd)]

    def _init(self, lim: SandboxLimits, argv: list[str], status_fd: int, env: dict[str, str], drop: dict | None,
              userns: dict | None) -> list[str]:
        """The namespace's init (init.py) with this run's settings, then the program's argv."""
        cpu = max(1, int(lim.cpu_s + 0.999))
        rlimits = {"cpu": (cpu, cpu + 1), "as": (_mib(lim.memory_mb),) * 2, "nproc": (int(lim.max_procs),) * 2,
                   "fsize": (_mib(lim.file_size_mb),) * 2, "core": (0, 0), "nofile": (int(lim.open_files),) * 2}
        cfg = {"status_fd": status_fd, "env": {**env, **_SANDBOX_ENV}, "rlimits": rlimits, "drop": drop, "userns": userns,
               "bpf": self._bpf_hex}
        return [self.python, "-I", "-S", "-B", "-c", _INIT_SOURCE, json.dumps(cfg, separators=(",", ":")), "--", *argv]

    def _bwrap(self, lim: SandboxLimits, files: list[tuple[int, str]], sockets: dict[str, str]) -> list[str]:
        cmd = [self._tools["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1", "--new-session",
               "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]
        for k, v in _SANDBOX_ENV.items():
            cmd += ["--setenv", k, v]
        cmd += ["--tmpfs", "/"]
        for path in self._ro_paths:
            cmd += ["--ro-bind", path, path]
        for path, target in self._links:
            cmd += ["--symlink", target, path]
        for inside, host in sockets.items():
            cmd += ["--ro-bind", host, inside]  # connect() works on a read-only mount (it writes to the socket, not the file)
        cmd += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",  # /dev/shm stays read-only
                "--size", str(_mib(lim.tmp_mb)), "--tmpfs", WORKDIR]
        for path in self._tmp_paths:  # after the sandbox's /tmp: on top of it (bwrap reads the source on the host)
            cmd += ["--ro-bind", path, path]
        for path, target in self._tmp_links:
            cmd += ["--symlink", target, path]
        for fd, name in files:
            cmd += ["--file", str(fd), f"{WORKDIR}/{name}"]
        return cmd + ["--chdir", WORKDIR, "--remount-ro", "/"]

    def _unshare(self, lim: SandboxLimits, files: list[tuple[int, str]], sockets: dict[str, str], init: list[str],
                 status_fd: int) -> list[str]:
        """unshare runs a setup script as the new pid namespace's first process: it builds the root on a
        tmpfs (mounted over /tmp, in the private mount namespace only), pivots into it and execs the
        init, which drops to the sandbox identity and runs the command as its child. Every name in
        the script is quoted; file names are checked in ``run`` as well."""
        q = shlex.quote
        lines = ["set -eu", "export PATH=/usr/sbin:/usr/bin:/sbin:/bin", "R=/tmp"]
        # A socket's host directory may be under /tmp, which the root's tmpfs is about to hide: it is
        # opened first (a descriptor 3-9 the run passes nothing on), bound through /proc/self/fd, closed.
        # Shown paths under the host's /tmp go the same way, through one descriptor held on the host's /tmp.
        free = [n for n in range(3, 10) if n != status_fd and n not in {fd for fd, _ in files}]
        if len(sockets) + 1 > len(free):
            raise ValueError(f"at most {len(free) - 1} sockets per sandbox run here, got {len(sockets)}")
        held = dict(zip(sockets, free))
        host_tmp = free[len(sockets)]
        lines += [f"exec {n}<{q(os.path.dirname(sockets[inside]))}" for inside, n in held.items()]
        if self._tmp_paths:
            lines.append(f"exec {host_tmp}<{WORKDIR}")
        lines.append('mount -t tmpfs -o mode=0755,size=4m,nosuid,nodev sandbox-root "$R"')
        for path in self._ro_paths:
            dst = '"$R"' + q(path)
            make = f"mkdir -p {dst}" if os.path.isdir(path) else f"mkdir -p \"$(dirname {dst})\" && touch {dst}"
            lines += [make, f"mount --bind {q(path)} {dst}", f"mount -o remount,bind,ro,nosuid,nodev {dst}"]
        for path, target in self._links:
            dst = '"$R"' + q(path)
            lines.append(f"mkdir -p \"$(dirname {dst})\" && ln -s {q(target)} {dst}")
        for inside, n in held.items():
            dst = '"$R"' + q(inside)
            lines += [f"mkdir -p \"$(dirname {dst})\" && touch {dst}",
                      f"mount --bind /proc/self/fd/{n}/{q(os.path.basename(sockets[inside]))} {dst}",
                      f"mount -o remount,bind,ro,nosuid,nodev {dst}", f"exec {n}<&-"]
        lines.append('mkdir "$R/dev" "$R/proc" "$R/tmp"')
        for dev in _DEVICES:
            lines += [f'touch "$R/dev/{dev}"', f'mount --bind /dev/{dev} "$R/dev/{dev}"']
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            lines.append(f'ln -s /proc/self/fd/{i} "$R/dev/{name}"')
        lines += ['ln -s /proc/self/fd "$R/dev/fd"',
                  'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
                  f'mount -t tmpfs -o mode=0755,size={_mib(lim.tmp_mb)},nosuid,nodev sandbox-tmp "$R/tmp"']
        for fd, name in files:
            lines.append(f'cat /dev/fd/{int(fd)} > "$R/tmp/"{q(name)}')  # (sh redirections only take fds 0-9)
        if self._as_nobody:
            lines.append(f'chown -R {NOBODY}:{NOBODY} "$R/tmp"')
        for path in self._tmp_paths:  # on top of the sandbox's /tmp, read-only, after its files and chown
            dst = '"$R"' + q(path)
            make = f"mkdir -p {dst}" if os.path.isdir(path) else f"mkdir -p \"$(dirname {dst})\" && touch {dst}"
            lines += [make, f"mount --bind /proc/self/fd/{host_tmp}/{q(os.path.relpath(path, WORKDIR))} {dst}",
                      f"mount -o remount,bind,ro,nosuid,nodev {dst}"]
        if self._tmp_paths:
            lines.append(f"exec {host_tmp}<&-")
        for path, target in self._tmp_links:
            dst = '"$R"' + q(path)
            lines.append(f"mkdir -p \"$(dirname {dst})\" && ln -s {q(target)} {dst}")
        lines += ['mkdir "$R/.oldroot"', 'cd "$R"', "pivot_root . .oldroot", "umount -l /.oldroot", "rmdir /.oldroot",
                  "mount -o remount,bind,ro /", f"cd {WORKDIR}", "exec " + " ".join(q(a) for a in init)]
        userns = [] if self._as_nobody else ["--user", "--map-root-user"]  # as root: a mount ns needs no user ns
        return [self._tools["unshare"], *userns, "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                "--net", "--ipc", "--uts", "--cgroup", "--", "/bin/sh", "-c", "\n".join(lines)]

    def _try(self, backend: str) -> str | None:
        """None when ``backend`` runs the interpreter here, else why not."""
        need = ["timeout", *(["bwrap"] if backend == "bwrap" else ["unshare", "mount", "pivot_root"]),
                *(["setpriv"] if self._as_nobody and backend == "bwrap" else [])]
        missing = [t for t in need if self._tools[t] is None]
        if missing:
            return f"{', '.join(missing)} not found"
        self.backend = backend
        res = self.run_python("print('ok')", SandboxLimits(wall_s=20.0))
        if res.stdout == "ok\n" and res.ok:
            if res.enforcement is not None and not res.enforcement.keyring:
                self.enforcement = Enforcement(self.enforcement.cgroup, self.enforcement.seccomp, False, self.enforcement.why)
                _warn_once("sandbox: the kernel refused a fresh session keyring (the seccomp filter still refuses key calls)")
            return None
        return f"trial run failed (exit {res.exit_code}, {res.killed_reason}): {res.stderr.strip()[-500:] or '(no stderr)'}"


# ---------------------------------------------------------------------- module-level API
_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()
_WARNED: set[str] = set()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox (backend chosen and tried once)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT


def run_python(code: str, limits: SandboxLimits | None = None, *, stdin: str | bytes = "",
               files: Mapping[str, str | bytes] | None = None) -> SandboxResult:
    """Run ``code`` in the default sandbox (see :class:`Sandbox.run_python`)."""
    return default_sandbox().run_python(code, limits, stdin=stdin, files=files)


# ---------------------------------------------------------------------- helpers
def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        log.warning(msg)


def _cgroup_root(explicit: str | None) -> tuple[CgroupRoot | None, str]:
    try:
        return find_cgroup_root(explicit), ""
    except CgroupUnavailable as e:
        return None, str(e)


def _default_python() -> str:
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _visible_paths(python: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(paths bound read-only at the same place, (link, target) symlinks) that make up the view."""
    ro = ["/usr"]
    links: list[tuple[str, str]] = []
    for path in _TOP_LEVEL:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            ro.append(path)
    ro += [p for p in _ETC if os.path.exists(p)]
    # The interpreter's prefix (<prefix>/bin/python), unless the view holds it already.
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if not any(prefix == p or prefix.startswith(p + "/") for p in ro) and prefix != "/":
        ro.append(prefix)
    return ro, links


def _resolve(path: str) -> tuple[str, list[tuple[str, str]]]:
    """(the real path of an existing absolute ``path``, the symbolic links met on the way there as (link,
    its target as written)), walking it component by component as the kernel does."""
    links: list[tuple[str, str]] = []
    todo = path.split("/")[::-1]  # a stack: a link's target is pushed in front of what is left
    real = "/"
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            real = os.path.dirname(real)
            continue
        here = os.path.join(real, name)
        if not os.path.islink(here):
            real = here
            continue
        if len(links) >= 40:  # the kernel's own limit (ELOOP)
            raise ValueError(f"too many symbolic links on the way to {path!r}")
        target = os.readlink(here)
        links.append((here, target))
        todo += target.split("/")[::-1]
        if target.startswith("/"):
            real = "/"
    return real, links


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _mib(n: float) -> int:
    return int(n * (1 << 20))


def _memfd(name: str, data: str | bytes) -> int:
    """An in-memory file holding ``data``, positioned at its start (no host file to clean up)."""
    fd = os.memfd_create(f"sandbox-{name}", 0)
    with open(fd, "wb", closefd=False) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _execute(cmd: list[str], lim: SandboxLimits, stdin_fd: int, pass_fds: list[int], status_r: int, status_w: int,
             cg: RunCgroup | None, enforcement: Enforcement) -> SandboxResult:
    """Start ``cmd``, collect bounded output until it ends, the wall time is up or (with a cgroup)
    the summed CPU time is, then make sure none of its processes is left."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
                                env=dict(_SANDBOX_ENV), cwd="/", start_new_session=True)
    finally:
        os.close(status_w)  # only the sandbox's init holds the write end now: EOF once it is gone
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    truncated = timed_out = cpu_out = exited = False
    deadline = start + lim.wall_s
    pidfd = os.pidfd_open(proc.pid)  # readable once the run's outermost process has exited
    try:
        with selectors.DefaultSelector() as sel:
            for f in bufs:
                sel.register(f, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            while len(sel.get_map()) > (0 if exited else 1) or not exited:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = not exited
                    break
                if cg is not None and not exited and cg.cpu_seconds() > lim.cpu_s + _CPU_GRACE_S:
                    cpu_out = True
                    break
                for key, _ in sel.select(min(left, _POLL_S) if cg is not None else left):
                    if key.fd == pidfd:
                        exited = True
                        sel.unregister(pidfd)
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = bufs[key.fileobj]
                    room = lim.output_bytes - len(buf)
                    truncated |= len(chunk) > room
                    buf += chunk[:max(room, 0)]  # the rest is drained and dropped
    finally:
        os.close(pidfd)
        if proc.poll() is None:
            if cg is not None:
                cg.kill()
            _stop(proc)
        proc.wait()
        for f in bufs:
            f.close()
    status = _read_status(status_r)
    reason = None
    if "signal" in status:
        code = -int(status["signal"])
    elif "exit" in status:
        code = int(status["exit"])
    else:  # the init itself was killed (wall/cpu limit, out of memory) or never started
        rc = proc.returncode
        code = 128 - rc if rc > 128 and rc - 128 in _SIGNALS else rc
    if "error" in status:  # the program never ran
        reason = f"sandbox setup failed: {status['error']}"
    oom = cg.oom_kills() if cg is not None else 0
    if timed_out:
        reason = f"wall time limit ({lim.wall_s:g} s)"
    elif cpu_out:
        reason = f"cpu time limit ({lim.cpu_s:g} s summed over the sandbox's processes)"
    elif oom:
        reason = f"memory limit ({lim.memory_mb:g} MiB for the whole sandbox: {oom} process(es) killed)"
    elif reason is None and code < 0:
        reason = _KILL_REASONS.get(-code)  # other signals are the program's own doing (SIGSEGV, SIGABRT, ...)
    setup = status.get("setup", {})
    ran = Enforcement(enforcement.cgroup, bool(setup.get("seccomp")), bool(setup.get("keyring")), enforcement.why)
    return SandboxResult(stdout=bufs[proc.stdout].decode("utf-8", errors="replace"),
                         stderr=bufs[proc.stderr].decode("utf-8", errors="replace"),
                         exit_code=code, timed_out=timed_out, killed_reason=reason,
                         wall_s=round(time.monotonic() - start, 3), truncated=truncated, enforcement=ran,
                         cpu_s=round(cg.cpu_seconds(), 3) if cg is not None else None,
                         peak_memory_mb=round(cg.peak_memory_bytes() / (1 << 20), 1) if cg is not None else None)


_SIGNALS = {s.value for s in signal.Signals}


def _read_status(fd: int) -> dict:
    """The init's status lines (see init.py), merged; {} when it wrote none."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    out: dict = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            out.update(json.loads(line))
        except (json.JSONDecodeError, TypeError, ValueError):
            pass
    return out


def _stop(proc: subprocess.Popen) -> None:
    """Kill a run and wait until none of its processes is left.

    The command is a child of the sandbox's pid-namespace init (a shell, the first descendant in
    another pid namespace). SIGKILL goes to the command: the shell exits with 128+9, the kernel
    then kills every other process of the namespace, whatever process groups or sessions they
    made, and the wrappers above (bwrap / unshare, timeout) exit by themselves, each reaping its
    child, so no zombie is left for the host's init. If that does not happen within a few seconds,
    the init and then everything else is SIGKILLed outright."""
    children = _children()
    tree = _descendants(proc.pid, children)
    own = _pid_ns(os.getpid())
    init = next((p for p in tree if _pid_ns(p) not in (own, None)), None)
    for p in (children.get(init) or [init]) if init else tree:
        _kill(p)
    if _exited(proc, 3):
        return
    if init:
        _kill(init)
        if _exited(proc, 3):
            return
    for p in [proc.pid, *_descendants(proc.pid, _children())]:
        _kill(p)
    proc.wait()


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc/*/stat."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int, children: dict[int, list[int]]) -> list[int]:
    """All descendants of ``pid``, parents first."""
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
