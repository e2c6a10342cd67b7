"""The sandbox's init: the first process of the sandbox's pid namespace, run by the system Python
(``python3 -I -S -B -c <this file> CONFIG_JSON -- ARGV...``; stdlib only, imported by nothing).

Why a program of our own rather than ``sh``: a shell reports "exit 152" and "killed by signal 24"
the same way (``$? == 152``), so a program could pass itself off as stopped by a limit; and the
per-run setup (a fresh session keyring, the seccomp filter, the rlimits) has to happen in the
program's own process, after the namespace setup that the filter forbids.

The init:
1. ignores every catchable signal (the kernel already drops default-action signals sent to a pid
   namespace's init from inside it; Python's own SIGINT handler would not be dropped) and makes
   itself non-dumpable, so code in the sandbox cannot open its ``/proc/1/fd`` or ``/proc/1/mem``;
2. forks the program's process, which, in order: drops to the sandbox identity (``drop``) and
   enters a user namespace of its own (``userns``: uid/gid map of one id), sets no-new-privs and
   the rlimits (after closing every descriptor but 0-2), joins a new anonymous session keyring, loads
   the seccomp filter (``bpf``, hex of ``struct sock_filter[]``) and ``execve``s ``ARGV`` with ``env``;
   a step that fails stops it before the program runs (exit 126, the reason on the status fd);
3. reaps every process that ends up as its child, and when the program's process ends, writes its
   real wait status as one JSON line on the status descriptor (``status_fd``, a pipe only the init
   holds) and exits; the kernel then kills whatever else is left in the namespace.

Status lines: ``{"setup": {"keyring": bool, "seccomp": bool}}`` (from the program's process,
before ``execve``), ``{"error": "..."}`` (a setup step failed), then ``{"exit": N}`` or
``{"signal": N}``.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
CLONE_NEWUSER = 0x10000000
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 280, "s390x": 280, "riscv64": 219}
RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC,
           "fsize": resource.RLIMIT_FSIZE, "core": resource.RLIMIT_CORE, "nofile": resource.RLIMIT_NOFILE}


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def report(fd, **msg):
    os.write(fd, (json.dumps(msg) + "\n").encode())


def check(ok, what):
    if ok != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def loopback_up():
    """``unshare --net`` leaves the new namespace's loopback down (bwrap brings it up); as root in
    that namespace (the unshare backend) the init brings it up, so the sandbox can talk to itself on
    127.0.0.1 (a black-box agent's endpoint bridge listens there). Elsewhere this is a no-op."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack("16sh14x", fcntl.ioctl(s, siocgifflags, struct.pack("16sh14x", b"lo", 0)))[1]
            if not flags & iff_up:
                fcntl.ioctl(s, siocsifflags, struct.pack("16sh14x", b"lo", flags | iff_up))
    except OSError:
        pass  # not allowed here (then bwrap has done it) or no loopback at all: nothing listens either way


def become_program(cfg, argv, libc):
    """The program's process: everything in step 2 of the module docstring, then execve."""
    status_fd = cfg["status_fd"]
    for sig in range(1, signal.NSIG):  # ignored dispositions survive execve: give the defaults back
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    drop = cfg.get("drop")
    if drop:
        os.setgroups([])
        os.setgid(drop["gid"])
        os.setuid(drop["uid"])
    # The init's non-dumpable flag (inherited, and set again by setuid) would make /proc/self root's:
    # the program's process owns its /proc files, as it will after execve anyway.
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    userns = cfg.get("userns")
    if userns:
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{userns['uid']} {outer_uid} 1"),
                           ("gid_map", f"{userns['gid']} {outer_gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    # Every inherited descriptor but 0-2 and the status pipe goes, while the old RLIMIT_NOFILE bounds their numbers.
    top = os.sysconf("SC_OPEN_MAX")
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, top)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(RLIMITS[name], (soft, hard))
    nr = SYS_KEYCTL.get(os.uname().machine)
    keyring = nr is not None and libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0
    bpf = bytes.fromhex(cfg.get("bpf") or "")
    if bpf:  # last: the filter refuses keyctl and unshare, which the steps above use
        buf = ctypes.create_string_buffer(bpf, len(bpf))
        prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "prctl(PR_SET_SECCOMP)")
    report(status_fd, setup={"keyring": bool(keyring), "seccomp": bool(bpf)})
    os.close(status_fd)
    os.execve(argv[0], argv, cfg["env"])


def main():
    cfg = json.loads(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    status_fd = cfg["status_fd"]
    libc = ctypes.CDLL(None, use_errno=True)
    for sig in range(1, signal.NSIG):
        if sig not in (signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    loopback_up()
    pid = os.fork()
    if pid == 0:
        try:
            become_program(cfg, argv, libc)
        except BaseException as e:  # noqa: BLE001 - the program must not run half set up
            try:
                report(status_fd, error=f"{type(e).__name__}: {e}")
            finally:
                os._exit(126)
    os.close(0)  # the init reads nothing; the program has its own copies of 0-2
    while True:
        try:
            done, wstatus = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(125)
        if done != pid:
            continue  # an orphan re-parented to us: reaped, so it does not count against pids
        if os.WIFSIGNALED(wstatus):
            report(status_fd, signal=os.WTERMSIG(wstatus))
            os._exit(128 + os.WTERMSIG(wstatus))
        report(status_fd, exit=os.WEXITSTATUS(wstatus))
        os._exit(os.WEXITSTATUS(wstatus))


main()
