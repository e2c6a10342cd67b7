"""LoRA adapters on an HF model (verl's `model.lora_rank / lora_alpha / target_modules / lora_dropout`).

`peft.inject_adapter_in_model` wraps each targeted linear layer in place, so the model keeps its HF
class, its FQNs and its decoder layers (FSDP2 still wraps one unit per layer); the only new names are

    X.weight  ->  X.base_layer.weight                 frozen (requires_grad False)
                  X.lora_A.default.weight  [r, in]    trained, random init
                  X.lora_B.default.weight  [out, r]   trained, zero init (the adapted model starts as the base)

and X(x) = base(x) + B @ A @ dropout(x) * lora_alpha / lora_rank. Frozen parameters get no gradient
and no optimizer state, and the 3D-HybridEngine moves them on the first weight switch only; every
later switch moves the adapters alone. The generation model carries the same adapters (unmerged), so
training and generation share names and the switch needs no renaming.

The reference policy is this model with its adapters disabled (`adapters_disabled`): the same base
operations in the same order, so reference log-probs equal the base model's bit for bit.

A vision-language model gets adapters on its language model only: the vision tower's linear layers
(Qwen2-VL's `model.visual.blocks.N.attn.qkv / proj`, `mlp.fc1 / fc2`; Qwen2.5-VL's `mlp.gate_proj / up_proj /
down_proj`, which `target_modules` names would match too; the merger's `model.visual.merger.mlp.0 / 2`) are
excluded whatever the targets, so the tower stays the frozen base (`models/vlm_inputs.py::VISION_TOWER_PATTERNS`).
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Iterator

from hybridflow.config.schema import ModelConfig

if TYPE_CHECKING:
    import torch.nn as nn

ADAPTER = "default"  # peft's adapter name


def lora_enabled(m: ModelConfig) -> bool:
    return m.lora_rank > 0


def is_adapter_param(name: str) -> bool:
    """An adapter parameter's FQN ("...q_proj.lora_A.default.weight")."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The plain HF name of a LoRA layer's frozen base ("...q_proj.base_layer.weight" -> "...q_proj.weight")."""
    return name.replace(".base_layer.", ".")


# peft's exclude_modules as one regex (re.fullmatch on a module's name): the vision tower of a VLM (transformers v5 nests
# it as model.visual, v4 as visual), whose modules never get an adapter.
VISION_TOWER_MODULES = r"(model\.)?visual(\..*)?"


def _is_vlm(m: ModelConfig) -> bool:
    from hybridflow.models.vlm import is_vlm_dir

    try:
        return bool(m.path) and is_vlm_dir(m.path)
    except (OSError, ValueError):  # an unreadable checkpoint fails where it is loaded
        return False


def lora_config(m: ModelConfig, exclude: tuple[str, ...] = ()):
    """peft's LoraConfig of `m`; `exclude`: module names (or name suffixes) without an adapter; a VLM's (`m.path` holds an
    image processor) vision tower is excluded too, so the same config builds the trainer's, the rollout's and the
    exported adapter's layers."""
    from peft import LoraConfig

    targets = m.target_modules[0] if list(m.target_modules) == ["all-linear"] else list(m.target_modules)
    skip: list[str] | str | None = list(exclude) or None
    if _is_vlm(m):  # one regex: peft takes a list of names or a single pattern
        skip = "|".join([VISION_TOWER_MODULES, *(rf"(.*\.)?{re.escape(x)}" for x in exclude)])
    return LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=targets, lora_dropout=m.lora_dropout, bias="none",
                      exclude_modules=skip)


def apply_lora(model: nn.Module, m: ModelConfig, full: tuple[str, ...] = ()) -> nn.Module:
    """Inject `m`'s adapters into `model` in place (a no-op with lora_rank 0); only adapters train,
    and the modules named in `full` (a new head, e.g. the critic's value head `score`), which get no
    adapter and train in full.

    "all-linear" (peft's meaning) is every linear layer but the output head. Raises ValueError when
    no module matches the targets."""
    if not lora_enabled(m):
        return model
    from peft import inject_adapter_in_model

    inject_adapter_in_model(lora_config(m, exclude=full), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name) or name.split(".")[0] in full)
    return model


def merged_state_dict(state: dict, model: nn.Module) -> dict:
    """A full state dict of `model` (adapter names) -> the plain HF model's: X.weight = base + B @ A * scaling
    for each LoRA layer X, the adapters dropped. Computed in fp32, cast back to the base's dtype."""
    from peft.tuners.lora import LoraLayer

    merged = {k: v for k, v in state.items() if ".base_layer." not in k and not is_adapter_param(k)}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            base = state[f"{name}.base_layer.weight"]
            a, b = state[f"{name}.lora_A.{ADAPTER}.weight"].float(), state[f"{name}.lora_B.{ADAPTER}.weight"].float()
            merged[f"{name}.weight"] = (base.float() + (b @ a) * mod.scaling[ADAPTER]).to(base.dtype)
            if f"{name}.base_layer.bias" in state:
                merged[f"{name}.bias"] = state[f"{name}.base_layer.bias"]
    return merged


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base: every LoRA layer forwards `base_layer(x)` alone.

    Sets peft's per-layer `_disable_adapters` flag (read by each layer's forward) and restores it.
    Not `model.disable_adapters()`: that also flips requires_grad, which FSDP2 parameters must keep."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [mod for mod in model.modules() if isinstance(mod, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was
