"""verl's entry point name: `python -m hybridflow.trainer.main_ppo KEY=VALUE ...` is `hybridflow train`
with the overrides of a verl quickstart command (verl-only keys are mapped, accepted or refused
with the reason: `config/verl_compat.py`). A YAML file may come first: `main_ppo CONFIG.yaml KEY=VALUE`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from hybridflow.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["train", *argv])


if __name__ == "__main__":
    sys.exit(main())
