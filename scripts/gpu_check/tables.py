"""scripts/gpu_check.sh's `tables` step: each step's result in one place, as docs quote it.

    python scripts/gpu_check/tables.py OUT      (OUT: the check's output folder, GPU_CHECK_OUT)
"""

from __future__ import annotations

import json
import pathlib
import sys


def section(log: pathlib.Path, start: str) -> list[str]:
    """The lines of `log` from the first one starting with `start` to the end."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    return [] if first is None else lines[first:]


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    env = out / "logs" / "env.log"
    if env.exists():
        print("[env]\n" + "\n".join(line for line in env.read_text().splitlines() if line and not line.startswith("==")))
    demo = out / "demo" / "summary.json"
    if demo.exists():
        s = json.loads(demo.read_text())
        print(f"\n[demo] torchrun, world size {s['world_size']}, GRPO in bf16: held-out accuracy after SFT {s['val_acc_after_sft']:.3f} -> "
              f"final {s['val_acc_final']:.3f} ({s['steps']} GRPO steps, SFT {s['sft_steps']} steps), {s['wall_seconds']:.1f} s")
    else:
        print("\n[demo] no summary.json")
    grpo = section(out / "logs" / "grpo.log", "GRPO step, torchrun")
    peak = [line for line in section(out / "logs" / "grpo.log", "") if line.startswith("bf16 matmul peak")]
    print("\n[grpo] " + ("\n".join(peak + grpo) if grpo else "no table"))
    rows = json.loads((out / "grpo.json").read_text()) if (out / "grpo.json").exists() else []
    for r in rows:
        print(f"[switch] {r['model']}: {r['backend']} world size 1, {r['switch_s']:.4f} s ({r['switch_gbs']:.1f} GB/s of bf16 weights), "
              f"max |generation - trained| {r['switch_max_diff']:g} over {r['steps_timed'] + 1} steps")
    exact = section(out / "logs" / "exact.log", "model ")
    print("\n[exact] " + ("\n".join(exact) if exact else "no table"))


if __name__ == "__main__":
    main()
