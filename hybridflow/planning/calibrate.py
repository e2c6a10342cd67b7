"""Measure this machine's collective bandwidth, latency and copy speed for the cost model.

Inside an initialized process group, `measure` times flat all-gathers of a few sizes and fits
seconds = latency * (n - 1) + bytes received per rank / bandwidth (least squares), and times a
local copy. `calibrate` spawns `procs` gloo processes on this machine, measures, and writes JSON
that `hybridflow plan --calibration PATH` reads. One machine has no inter-node link: the measured
bandwidth stands for both.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time

SIZES = (1 << 18, 1 << 21, 1 << 23)  # bytes each rank contributes


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(group=None, sizes: tuple[int, ...] = SIZES, repeats: int = 5, device: str = "cpu") -> dict:
    """Fit bandwidth and latency from all-gathers over `group` (every rank of it calls this)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    points = []
    for size in sizes:
        inp = torch.ones(size // 4, dtype=torch.float32, device=device)
        out = torch.empty(n * inp.numel(), dtype=torch.float32, device=device)

        def gather():
            dist.barrier(group=group)
            dist.all_gather_into_tensor(out, inp, group=group)

        seconds = torch.tensor([_median_seconds(gather, repeats)])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
        points.append(((n - 1) * size, float(seconds)))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(0.0, my - slope * mx)
    src = torch.ones(sizes[-1] // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), repeats)
    bw = 1.0 / slope if slope > 0 else max(xs) / max(ys)
    return {"procs": n, "bandwidth": bw, "latency_s": intercept / max(1, n - 1), "copy_bw": sizes[-1] / copy_s,
            "points": [{"bytes_received": x, "seconds": y} for x, y in points]}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = measure()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def calibrate(procs: int = 2, path: str | None = None) -> dict:
    """Spawn `procs` gloo processes, measure, return (and write to `path`) the calibration."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cal.json")
        mp.spawn(_worker, args=(procs, port, out), nprocs=procs)
        with open(out) as f:
            result = json.load(f)
    result.update(intra_node_bw=result["bandwidth"], inter_node_bw=result["bandwidth"], machine=socket.gethostname())
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def load_calibration(path: str) -> dict:
    with open(path) as f:
        cal = json.load(f)
    missing = {"intra_node_bw", "inter_node_bw", "latency_s", "copy_bw"} - set(cal)
    if missing:
        raise ValueError(f"{path} is not a calibration file (missing {sorted(missing)}); write one with `hybridflow plan --calibrate --out {path}`")
    return cal
