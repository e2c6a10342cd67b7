"""One control group per sandbox run, so that its limits hold for the whole sandbox.

rlimits are per process: four processes of 200 MiB each pass a 256 MiB ``RLIMIT_AS``, every child
gets its own ``RLIMIT_CPU``, and pages of memfds, shared memory and tmpfs files are not counted at
all. A cgroup counts all of it: ``memory`` (anonymous memory plus page cache, tmpfs and shared
memory pages, charged to the cgroup that touched them), ``pids`` (processes and threads) and the
CPU time of every process, summed (read here and enforced by the host, which kills the run when
the sum passes ``cpu_s``).

Two layouts, the same per-run contract (:class:`RunCgroup`):

- **cgroup v2** (most user machines): a directory under a *delegated* subtree, with
  ``memory.max``, ``memory.swap.max = 0``, ``pids.max``; usage from ``cpu.stat``; teardown through
  ``cgroup.kill``. The base is ``HYBRIDFLOW_SANDBOX_CGROUP`` when set, else the parent of this
  process's own cgroup (a process's own cgroup cannot get controllers for children while it holds
  processes). Under systemd, a base of your own: ``systemd-run --user --scope -p Delegate=yes ...``.
- **cgroup v1** (what our CI machines have): the same directory in each of the ``memory``,
  ``pids`` and ``cpuacct`` hierarchies, ``memory.limit_in_bytes`` (and ``memsw`` where swap is
  accounted), ``pids.max``, ``cpuacct.usage``.

Processes join before anything of the run starts: the host launches the run through
``sh -c 'echo $$ > .../cgroup.procs ...; exec "$@"'`` (:meth:`RunCgroup.join_prefix`), so every
wrapper and every process the code starts is counted from its first page on.

Where none of this is writable, :func:`find_cgroup_root` says why and the sandbox falls back to
per-process rlimits, reporting it in every result (``SandboxResult.enforcement``) rather than
silently enforcing less.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass

V1_CONTROLLERS = ("memory", "pids", "cpuacct")
GROUP = "hybridflow-sandbox"  # the directory our run cgroups live under
ENV = "HYBRIDFLOW_SANDBOX_CGROUP"  # a v1 root (holding memory/, pids/, cpuacct/), a v2 directory, or "none"
# Processes of ours around the code that live in the run's cgroup (timeout, setpriv/bwrap and its
# monitor, the unshare helper and init): pids.max leaves them room over ``max_procs``.
WRAPPER_PROCS = 6


class CgroupUnavailable(RuntimeError):
    """No cgroup this process can create and fill; the message says which path and why."""


@dataclass(frozen=True)
class CgroupRoot:
    """Where run cgroups are made: ``version`` 1 or 2, ``path`` the v1 mount root or the v2 base."""

    version: int
    path: str

    def dirs(self, name: str) -> list[str]:
        if self.version == 2:
            return [os.path.join(self.path, GROUP, name)]
        return [os.path.join(self.path, c, GROUP, name) for c in V1_CONTROLLERS]

    def create(self, memory_bytes: int, max_procs: int) -> "RunCgroup":
        return RunCgroup(self, f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}", memory_bytes, max_procs)


class RunCgroup:
    """The cgroup of one run: created with its limits, joined by the run's first process, read
    while it runs (CPU), killed and removed at the end."""

    def __init__(self, root: CgroupRoot, name: str, memory_bytes: int, max_procs: int):
        self.root, self.version = root, root.version
        self.paths = root.dirs(name)
        made = []
        try:
            for p in self.paths:
                os.mkdir(p)
                made.append(p)
                if not os.path.exists(os.path.join(p, "cgroup.procs")):  # the kernel fills a new cgroup's directory
                    raise OSError(0, f"{os.path.dirname(p)} is not on a cgroup file system")
            if self.version == 2:
                (d,) = self.paths
                _write(d, "memory.max", memory_bytes)
                _write(d, "memory.swap.max", 0, missing_ok=True)
                _write(d, "pids.max", max_procs + WRAPPER_PROCS)
            else:
                mem, pids, _ = self.paths
                _write(mem, "memory.limit_in_bytes", memory_bytes)
                _write(mem, "memory.memsw.limit_in_bytes", memory_bytes, missing_ok=True)
                _write(pids, "pids.max", max_procs + WRAPPER_PROCS)
        except OSError:
            for p in reversed(made):
                _rmdir(p)
            raise

    def join_prefix(self) -> list[str]:
        """A command prefix that moves the process into this cgroup, then execs the rest."""
        script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sandbox-cgroup", *(os.path.join(p, "cgroup.procs") for p in self.paths), "--"]

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every process the run had, summed."""
        try:
            if self.version == 2:
                for line in _read(self.paths[0], "cpu.stat").splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return 0.0
            return int(_read(self.paths[2], "cpuacct.usage")) / 1e9
        except (OSError, ValueError):
            return 0.0

    def oom_kills(self) -> int:
        """Processes the kernel killed for going over the memory limit."""
        try:
            text = _read(self.paths[0], "memory.events" if self.version == 2 else "memory.oom_control")
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak_memory_bytes(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(self.paths[0], name))
        except (OSError, ValueError):
            return 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(self.paths[-1 if self.version == 2 else 1], "cgroup.procs").split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (v2: atomically, through cgroup.kill)."""
        if self.version == 2 and os.path.exists(os.path.join(self.paths[0], "cgroup.kill")):
            try:
                _write(self.paths[0], "cgroup.kill", 1)
                return
            except OSError:
                pass
        for _ in range(50):  # a fork can race one pass; pids.max bounds how many there can be
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self, timeout: float = 2.0) -> None:
        """Kill what is left and remove the directories (a cgroup is removable once it is empty)."""
        deadline = time.monotonic() + timeout
        self.kill()
        for p in self.paths:
            while not _rmdir(p) and time.monotonic() < deadline:
                self.kill()
                time.sleep(0.01)


def find_cgroup_root(explicit: str | None = None) -> CgroupRoot:
    """The place to make run cgroups: ``explicit`` (or ``$HYBRIDFLOW_SANDBOX_CGROUP``), else the
    machine's v1 hierarchies, else a v2 base next to this process's cgroup. Checks that a run
    cgroup can be made and limited there; :class:`CgroupUnavailable` says why not."""
    where = explicit if explicit is not None else os.environ.get(ENV)
    if where is not None and where.strip().lower() in ("", "none", "off", "0"):
        raise CgroupUnavailable(f"disabled ({ENV}={where!r})")
    candidates = [where] if where else _auto_candidates()
    reasons = []
    for path in candidates:
        root = _classify(path)
        if root is None:
            reasons.append(f"{path}: neither a cgroup v2 directory nor a v1 root with {'/'.join(V1_CONTROLLERS)}")
            continue
        try:
            _prepare(root)
            probe = root.create(64 << 20, 1)
            probe.remove()
            return root
        except OSError as e:
            reasons.append(f"{path} (cgroup v{root.version}): {e.strerror or e}")
    raise CgroupUnavailable("; ".join(reasons) or "no cgroup file system mounted")


def _auto_candidates() -> list[str]:
    out = []
    if all(os.path.isdir(f"/sys/fs/cgroup/{c}") for c in V1_CONTROLLERS):
        out.append("/sys/fs/cgroup")
    own = _own_v2_cgroup()
    if own is not None:
        out.append(os.path.dirname(own) if own != "/sys/fs/cgroup" else own)
    return out


def _own_v2_cgroup() -> str | None:
    """This process's cgroup v2 directory (``0::/path`` in /proc/self/cgroup), if v2 is the main mount."""
    if not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return os.path.normpath("/sys/fs/cgroup" + line[3:].strip())
    except OSError:
        pass
    return None


def _classify(path: str) -> CgroupRoot | None:
    if os.path.exists(os.path.join(path, "cgroup.controllers")):
        return CgroupRoot(2, path)
    if all(os.path.isdir(os.path.join(path, c)) for c in V1_CONTROLLERS):
        return CgroupRoot(1, path)
    return None


def _prepare(root: CgroupRoot) -> None:
    """Make our group directory (once) and, on v2, hand the memory and pids controllers down to it."""
    if root.version == 2:
        need = {"memory", "pids"}
        have = set(_read(root.path, "cgroup.controllers").split())
        if not need <= have:
            raise OSError(0, f"controllers {sorted(need - have)} are not delegated here")
        _enable(root.path, need | ({"cpu"} & have))
        group = os.path.join(root.path, GROUP)
        os.makedirs(group, exist_ok=True)
        _enable(group, need | ({"cpu"} & have))
        return
    for c in V1_CONTROLLERS:
        os.makedirs(os.path.join(root.path, c, GROUP), exist_ok=True)


def _enable(path: str, controllers: set[str]) -> None:
    enabled = set(_read(path, "cgroup.subtree_control").split())
    missing = controllers - enabled
    if missing:
        _write(path, "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))


def _read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as f:
        return f.read()


def _write(d: str, name: str, value: object, missing_ok: bool = False) -> None:
    path = os.path.join(d, name)
    if missing_ok and not os.path.exists(path):
        return
    with open(path, "w") as f:
        f.write(str(value))


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
