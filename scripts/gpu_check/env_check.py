"""scripts/gpu_check.sh's `env` step: the versions the check runs on, and that everything its steps
import loads here without Ray (a torchrun-only install: one node, no Ray) and without vLLM.

    python scripts/gpu_check/env_check.py --device cuda|cpu
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the steps import: the torchrun demo (examples/train_ppo.py), bench/grpo_device.py, bench/exact_device.py.
MODULES = ("hybridflow.controller.local_group", "hybridflow.controller.worker", "hybridflow.data.tasks", "hybridflow.demo",
           "hybridflow.models.tiny", "hybridflow.trainer.rl", "hybridflow.trainer.sft", "hybridflow.planning.arch",
           "hybridflow.rollout.hf_rollout", "hybridflow.models.exact", "hybridflow.parallel.fsdp", "hybridflow.parallel.process_group")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    t = time.perf_counter()
    import torch
    import transformers

    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}")
    for name in ("peft", "accelerate", "pyarrow", "pandas", "omegaconf", "numpy"):
        try:
            mod = importlib.import_module(name)
            print(f"{name} {getattr(mod, '__version__', '?')} ({os.path.dirname(mod.__file__)})")
        except ImportError as e:
            print(f"{name}: not importable ({e})")
    if a.device == "cuda":
        assert torch.cuda.is_available(), "torch sees no GPU"
        p = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        print(f"GPU: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}, "
              f"NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    sys.path.insert(0, ROOT)
    from hybridflow.config.validate import CHECK_MODULES  # what validating a config imports (each component's checks)

    for m in (*MODULES, *CHECK_MODULES):
        importlib.import_module(m)
    loaded = sorted(m for m in ("ray", "vllm") if m in sys.modules)
    assert not loaded, f"importing the check's modules loaded {loaded}: the torchrun path must not"
    installed = {m: importlib.util.find_spec(m) is not None for m in ("ray", "vllm")}
    print(f"hybridflow's trainer, demo, benches and config checks import ({len(MODULES) + len(CHECK_MODULES)} modules, {time.perf_counter() - t:.1f} s); "
          f"Ray loaded: no (installed: {'yes' if installed['ray'] else 'no'}), vLLM installed: {'yes' if installed['vllm'] else 'no'}")


if __name__ == "__main__":
    main()
