"""Peak-memory measurement around one operation, per process.

CUDA: the caching allocator's peak. CPU: the kernel's resident-set high-water mark (VmHWM), reset
through /proc/self/clear_refs before the operation. Exact when the process runs with
MALLOC_MMAP_THRESHOLD_=65536 (bench/reshard.py, the memory test; add it to trainer.worker_env):
every large tensor is then its own mmap and is returned to the OS when freed; otherwise glibc may
keep freed memory and the RSS under-reports what an operation needs.
"""

from __future__ import annotations

import torch


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


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
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
            except OSError:
                pass
            self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status("VmHWM")
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
    return _status("VmRSS")
