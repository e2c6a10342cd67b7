"""The CPU rehearsal of scripts/gpu_check.sh: the GPU check's every step executed on CPU (tiny
shapes, the bootstrap venv with only the GPU image's and the carried packages importable: Ray, vLLM
and everything else hidden, scripts/gpu_check/), so the check cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTS_PROCESSES = True  # torchrun (the demo, bench/grpo_device.py) and a gloo group (bench/exact_device.py)


def test_the_gpu_check_rehearsed_on_cpu_passes_every_step(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), "GPU_WHEELS_DIR": str(tmp_path / "no_wheels")})
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.rstrip().endswith("gpu_check: all steps passed")
    steps = re.findall(r"^(\w+)\s+ok\s+[\d.]+\s+\d+$", (tmp_path / "out" / "steps.txt").read_text(), re.M)
    assert steps == ["device", "wheels", "env", "demo", "grpo", "exact", "tables"]
    # the torchrun path ran with Ray not importable
    assert "Ray loaded: no (installed: no), vLLM installed: no" in out
    demo = json.loads((tmp_path / "out" / "demo" / "summary.json").read_text())
    assert demo["launcher"] == "torchrun" and demo["world_size"] == 1 and demo["steps"] == 3
    rows = json.loads((tmp_path / "out" / "grpo.json").read_text())
    assert [r["model"] for r in rows] == ["smollm2-135m", "qwen2.5-0.5b"]
    for r in rows:
        assert r["switch_max_diff"] == 0.0 and r["tok_s"] > 0 and 0 < r["mfu_step"] < 1
        assert all(r[f"{k}_s"] > 0 for k in ("gen", "log_probs", "update", "switch"))
    assert "exact mode bit for bit on cpu in every row: yes" in out
    assert "[demo] torchrun, world size 1, GRPO in bf16: held-out accuracy after SFT" in out  # the tables step
    assert seconds < 120, f"the rehearsal took {seconds:.0f} s"
