"""Peak-memory measurement around one operation, per process.

CUDA: the caching allocator's peak. CPU: the kernel's resident-set high-water mark (VmHWM), reset
through /proc/self/clear_refs before the operation. Exact when the process runs with
MALLOC_MMAP_THRESHOLD_=65536 (bench/reshard.py, the memory test; add it to trainer.worker_env):
every large tensor is then its own mmap and is returned to the OS when freed; otherwise glibc may
keep freed memory and the RSS under-reports what an operation needs.
"""

from __future__ import annotations

import torch


def status_bytes(key: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """with PeakMemory(device) as m: ...; m.extra_bytes = peak during the block - usage before it."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.extra_bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            reset_peak()
            self.before = status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = status_bytes("VmHWM")
        self.extra_bytes = max(0, peak - self.before)


def allocation_bytes(nbytes: int, device: str = "cpu") -> int:
    """What the allocator really takes for one tensor of `nbytes`: CUDA rounds blocks to 512 B;
    on CPU (with MALLOC_MMAP_THRESHOLD_=65536) a large tensor is its own mmap, a 16 B header plus
    whole 4 KiB pages."""
    if device == "cuda":
        return -(-nbytes // 512) * 512
    if nbytes >= 65536:
        return -(-(nbytes + 16) // 4096) * 4096
    return nbytes


def rss_bytes() -> int:
    return status_bytes("VmRSS")
