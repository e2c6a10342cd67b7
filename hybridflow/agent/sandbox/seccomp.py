"""The sandbox's seccomp filter: the system calls sandboxed code is refused, compiled once with
libseccomp (through ``pyseccomp``, a ctypes binding) into a classic BPF program.

Why a filter on top of the namespaces: some kernel objects are not namespaced (the key
management facility: a session keyring is reachable from any namespace), and some calls are the
usual first step of a kernel exploit or a way around the other limits (``ptrace`` of the sandbox's
own init to outlive the wall time, ``unshare(CLONE_NEWUSER)`` to gain capabilities over a private
tmpfs, ``userfaultfd``, ``bpf``, ``perf_event_open``). Programs that grade answers or run a tool
need none of them. Sockets are allow-listed by family (``SOCKET_FAMILIES``): ``AF_UNIX``,
``AF_INET`` and ``AF_INET6`` for ``socket``, ``AF_UNIX`` for ``socketpair``. The network namespace
isolates those (its own loopback only), but not every family: ``AF_VSOCK`` is not namespaced and
on a VM reaches the hypervisor's host, and ``AF_PACKET``, ``AF_NETLINK``, ``AF_ALG``, ``AF_TIPC``,
... are kernel surface with a long CVE record that no graded program or agent needs. (glibc's
``getaddrinfo`` with ``AI_ADDRCONFIG`` asks NETLINK which address families are configured and,
refused, assumes both; ``socket.if_nameindex()`` and ``getifaddrs`` do fail.)

A refused call fails with ``EPERM`` (``ENOSYS`` for ``clone3``, so the C library falls back to
``clone``, whose flags the filter can inspect), never by killing the process: the program sees an
ordinary error.

The host builds the program once (:func:`filter_bpf`) and hands it to the sandbox's init
(``init.py``) as hex on its command line; the init loads it in the child right before ``execve``,
after its own setup (which needs ``unshare`` and ``mount``) is done.
"""

from __future__ import annotations

import errno
import functools
import io
import logging

log = logging.getLogger(__name__)

# Refused outright. Grouped by why; a name this kernel or libseccomp does not know is skipped.
DENIED = (
    # kernel keyrings are not namespaced: no reading the host's keys, no planting one for the next run
    "add_key", "request_key", "keyctl",
    # no debugging or poking at other processes (the sandbox's init among them)
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # no new namespaces or mounts (nested user namespaces would grant capabilities)
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    # kernel attack surface no graded program needs
    "bpf", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "open_by_handle_at", "name_to_handle_at", "syslog", "lookup_dcookie", "iopl", "ioperm",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init", "vhangup",
)
# clone with any of these flags creates a namespace (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC,
# NEWUSER, NEWPID, NEWNET): refused. Plain fork / thread creation passes.
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # push bytes into a terminal's input / console tricks
# The socket families sandboxed code may open: AF_UNIX, AF_INET, AF_INET6 (socket); AF_UNIX (socketpair).
# Every other value of the family argument gets EPERM.
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
SOCKETPAIR_FAMILIES = (AF_UNIX,)


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its Python binding) is missing, so no filter can be built."""


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled filter for this machine's architecture (struct sock_filter[] as bytes)."""
    try:
        import pyseccomp as sc
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError/RuntimeError when libseccomp.so is missing
        raise SeccompUnavailable(f"pyseccomp/libseccomp not usable: {type(e).__name__}: {e} "
                                 "(pip install pyseccomp; Debian: apt-get install libseccomp2)") from e
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    skipped = []
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except Exception:  # noqa: BLE001 - unknown on this arch/libseccomp (e.g. iopl on arm64)
            skipped.append(name)
    for flag in CLONE_NEW_FLAGS:
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for req in (TIOCSTI, TIOCLINUX):
        f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, req))
    for call, allowed in (("socket", SOCKET_FAMILIES), ("socketpair", SOCKETPAIR_FAMILIES)):
        for rule in _deny_all_but(sc, allowed):
            f.add_rule(eperm, call, rule)
    try:
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags live in memory the filter cannot read
    except Exception:  # noqa: BLE001 - a libseccomp too old to know clone3: the kernel may still have it
        skipped.append("clone3")
    if skipped:
        log.debug("seccomp: not on this architecture or libseccomp: %s", ", ".join(skipped))
    return _export(f)


def _deny_all_but(sc, allowed: tuple[int, ...]) -> list:
    """Comparisons on argument 0 that together match every value except those in ``allowed``.

    The default action is ALLOW and libseccomp ORs rules (one rule may not compare an argument twice),
    so the deny set is spelled out: ``> max(allowed)``, plus ``== k`` for each gap below it. libseccomp
    compares all 64 bits of the register on a 64-bit architecture, while the kernel truncates the
    family to an int: a raw ``syscall(SYS_socket, (1 << 32) | AF_VSOCK, ...)`` is ``> 10`` and refused,
    and so is any value with upper bits set (``(1 << 32) | AF_INET`` too: no program passes one). Were
    the comparison on the low 32 bits only, the same rules refuse every denied family as well."""
    top = max(allowed)
    return [sc.Arg(0, sc.GT, top)] + [sc.Arg(0, sc.EQ, k) for k in range(top) if k not in allowed]


def _export(f) -> bytes:
    """libseccomp writes the program to a file descriptor; a pipe-free way is a memfd."""
    import os

    fd = os.memfd_create("hybridflow-seccomp", 0)
    try:
        with io.FileIO(fd, "w+", closefd=False) as out:
            f.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    if not data or len(data) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(data)} bytes, not a BPF program")
    return data
