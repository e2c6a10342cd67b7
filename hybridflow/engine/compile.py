"""`torch.compile` of a model's decoder layers (actor/ref `use_torch_compile`, verl's key).

torchtitan's recipe: each decoder block is compiled on its own, not the whole model. Here the
block's `forward` is replaced by its compiled version, so the module's own `__call__` (and the
hooks FSDP2 registers on it: all-gather before, reshard after, the gradient reduce-scatter in
backward) stays eager and runs around the compiled region; inside it the block sees plain
(unsharded, and under a MixedPrecisionPolicy already cast) parameters. Per block the compiled
graph fuses what runs between the matmuls: RMSNorm's cast / square / mean / rsqrt / scale, the
rotary embedding, SiLU x up, the residual adds, and their backward, which on a CPU with AMX cost
more than the bf16 matmuls themselves (docs/performance.md). On CPU the backend is inductor's C++
code generator (gcc), on CUDA Triton.

Every block of a model runs the same code on parameters of the same shapes, so one compiled graph
serves all of them (dynamo treats the block's parameters as graph inputs); a new sequence length
recompiles once, after which dynamo marks the changing dims dynamic. `compile_stats()` reads
dynamo's counters (graphs built, graph breaks, recompiles) for the benches.

What stays eager: the embedding, the mask construction and rotary tables (once per forward, in
the model's own forward), the final norm, and the chunked log-prob head (`fused_logprobs.py`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

_COMPILED = "_hybridflow_compiled"
_CLASSES: set[type] = set()  # the layer classes compiled in this process (each one code object, its first graph not a recompile)


def compile_decoder_layers(model: nn.Module, dynamic: bool | None = None) -> int:
    """Compile each decoder layer's forward in place (idempotent); the number of layers compiled.
    Call it before or after `fully_shard`: the hooks live on the module, the compiled code in
    `forward` (see the module doc). dynamic: torch.compile's (None = static first, then dynamic
    on the first shape change)."""
    from hybridflow.parallel.fsdp import decoder_layers

    n = 0
    for layer in decoder_layers(model):
        if getattr(layer, _COMPILED, False):
            continue
        _CLASSES.add(type(layer))
        layer.forward = torch.compile(layer.forward, dynamic=dynamic)  # an instance attribute: the class's forward stays eager
        setattr(layer, _COMPILED, True)
        n += 1
    return n


def is_compiled(model: nn.Module) -> bool:
    return any(getattr(m, _COMPILED, False) for m in model.modules())


def compile_stats() -> dict[str, int]:
    """dynamo's process-wide counters: graphs built, graph breaks (summed over their reasons),
    recompiles (graphs built again for a compiled layer's code after a guard failed: a new sequence
    length before the dims turn dynamic, a new dtype)."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"].get("unique_graphs", 0))
    return {"compile/graphs": graphs, "compile/graph_breaks": int(sum(counters["graph_break"].values())),
            "compile/recompiles": max(0, graphs - len(_CLASSES))}  # graphs beyond the first of each compiled layer class
