"""The parallel layout of a role: ONE object for how its ranks train and generate (torchtitan's ParallelDims).

    dims = ParallelDims(pp=2, tp=2, dp=2)             # 8 ranks, checked when made (ValueError)
    dims = ParallelDims.for_world(8, pp=2, tp=2)      # dp = world / (pp x tp)
    dims = dims.with_gen(4)                           # + the generation layout: gen_tp (and its grouping)
    dims.coords(r) -> (pp_i, dp_i, tp_i); dims.dispatch(r); dims.gen_rank(r) -> (generation TP, DP index)

Training: rank r = (pp_i * dp + dp_i) * tp + tp_i (tp innermost, then dp, then pp), so a TP group is
tp consecutive ranks and a pipeline is the ranks that share (dp_i, tp_i); FSDP2 shards over dp.

Generation: TP groups of gen_tp ranks, gen_dp = world / gen_tp replicas, grouped one of two ways:
- strided (HybridFlow's micro-DP grouping, the default): along a sharded dim a rank holds training
  slice j = tp_i * dp + dp_i of M = tp * dp. gen_tp | M -> TP index j // k, DP index pp_i * k + j % k
  (k = M / gen_tp); M | gen_tp -> TP index j * c + pp_i % c, DP index pp_i // c (c = gen_tp / M). A
  generation slice is then made of whole training slices. FSDP layout (pp = tp = 1): rank r has TP
  index r // k and DP index r % k, the TP groups are the strided sets {j, j+k, j+2k, ...}.
- consecutive (vLLM's launcher): TP index r % gen_tp, DP index r // gen_tp.

The rules, checked when the object is made (one ValueError naming every size that does not fit):
- pp, tp, dp, gen_tp and procs_per_node are integers >= 1;
- gen_tp divides tp x dp, or is tp x dp times a divisor of pp (either way it divides the world);
- procs_per_node (ranks per node, numbered consecutively; None = all on one node) divides the world;
- sp (Ulysses sequence parallel, `parallel/ulysses.py`) divides dp and needs pp = tp = 1: FSDP2 still
  shards over all dp ranks, and each group of sp consecutive ranks trains on the same rows (the data
  is split over dp / sp), as verl does.
- ep (expert parallelism, `parallel/expert_parallel.py`) divides dp and needs pp = tp = 1: the dp ranks
  form (dp / ep, ep), ep innermost; each keeps its own data split (EP trades tokens, not batches).

No torch here: the driver-side config validator runs these rules (the layout checks in
`hybridflow/run_plan.py`, registered with `hybridflow.config.validate`) before any worker starts. The device mesh is
built on the workers by `parallel/layout.py::train_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"  # the generation TP size's config key


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _size_ok(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def layout_choices(world: int) -> list[tuple[int, int]]:
    """(pp, tp) pairs other than (1, 1) whose product divides `world` (the 3D layouts it allows)."""
    return [(a, b) for a in range(1, world + 1) for b in range(1, world + 1) if world % (a * b) == 0 and a * b > 1]


@dataclass(frozen=True)
class ParallelDims:
    """pp x tp x dp training ranks (world = pp * tp * dp) and their generation layout (gen_tp,
    consecutive or strided TP groups), procs_per_node ranks per node; `label` e.g. "pp2xtp8xdp4"."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    gen_tp: int = 1
    consecutive: bool = False  # generation TP groups of consecutive ranks (vLLM) instead of strided (HybridFlow)
    procs_per_node: int | None = None  # None: every rank on one node
    sp: int = 1  # Ulysses sequence parallel: sp consecutive ranks of dp share one data split (module doc)
    # Expert parallelism (parallel/expert_parallel.py) borrows from dp as sp does: the dp ranks form (dp / ep, ep),
    # ep innermost; EP rank dp_i % ep holds experts [i * E/ep, (i+1) * E/ep), FSDP2 shards them over dp / ep.
    ep: int = 1

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError(f"parallel layout pp={self.pp!r} x tp={self.tp!r} x dp={self.dp!r}, gen_tp={self.gen_tp!r}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What does not fit (empty when the layout is valid)."""
        sizes = {"pp": self.pp, "tp": self.tp, "dp": self.dp, "gen_tp": self.gen_tp}
        if self.ep != 1:
            sizes["ep"] = self.ep
        if self.procs_per_node is not None:
            sizes["procs_per_node"] = self.procs_per_node
        if self.sp != 1:
            sizes["sp"] = self.sp
        out = [f"{name} must be an integer >= 1, got {v!r}" for name, v in sizes.items() if not _size_ok(v)]
        if out:
            return out
        if self.dp % self.sp or (self.sp > 1 and not self.trivial):
            out.append(f"sp ({self.sp}) must divide dp ({self.dp}) with pp = tp = 1 (Ulysses shards the sequence within the FSDP ranks)")
        if self.ep > 1 and (self.dp % self.ep or self.pp > 1 or self.tp > 1):
            out.append(f"ep ({self.ep}) must divide dp ({self.dp}) and needs pp = tp = 1 (expert parallelism is built on the FSDP layout)")
        if self.world % self.gen_tp:
            out.append(f"gen_tp ({self.gen_tp}) must divide the world size ({self.world} = pp x tp x dp); set it to one of {divisors(self.world)}")
        elif not self.fits_gen_tp(self.gen_tp):
            out.append(self.gen_tp_problem(self.gen_tp))
        if self.procs_per_node is not None and self.world % self.procs_per_node:
            out.append(f"procs_per_node ({self.procs_per_node}) must divide the world size ({self.world}): the ranks fill whole "
                       f"nodes of procs_per_node consecutive ranks; set it to one of {divisors(self.world)}")
        return out

    @classmethod
    def for_world(cls, world: int, pp: int = 1, tp: int = 1, **gen) -> "ParallelDims":
        """pp x tp x dp over `world` ranks (dp = world / (pp x tp)); `gen`: gen_tp, consecutive, procs_per_node."""
        if not (_size_ok(world) and _size_ok(pp) and _size_ok(tp)):
            raise ValueError(f"the world size, pp and tp must be integers >= 1, got {world!r}, {pp!r}, {tp!r}")
        if world % (pp * tp):
            raise ValueError(f"pp x tp ({pp} x {tp} = {pp * tp}) must divide the world size {world} (dp = world / (pp x tp)); "
                             f"use (pp, tp) such as {[(1, 1), *layout_choices(world)[:3]]}")
        return cls(pp, tp, world // (pp * tp), **gen)

    def with_gen(self, gen_tp: int, consecutive: bool | None = None, procs_per_node: int | None = None) -> "ParallelDims":
        """This training layout with the generation layout `gen_tp` (checked); None keeps the current value."""
        return replace(self, gen_tp=gen_tp, consecutive=self.consecutive if consecutive is None else consecutive,
                       procs_per_node=self.procs_per_node if procs_per_node is None else procs_per_node)

    # ---- training layout
    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def trivial(self) -> bool:
        """Plain FSDP over every rank (no pipeline stages, no training TP, no expert parallelism)."""
        return self.pp == self.tp == self.ep == 1

    @property
    def label(self) -> str:
        parts = [f"{n}{v}" for n, v in (("pp", self.pp), ("tp", self.tp), ("sp", self.sp), ("ep", self.ep)) if v > 1]
        return "x".join([*parts, f"dp{self.dp}"])

    @classmethod
    def parse(cls, text: str) -> "ParallelDims":
        """"pp2xtp8xdp4" / "tp2xdp2" / "dp4" / "sp2xdp4" / "ep2xdp4" (any order, missing factors 1)."""
        sizes = {"pp": 1, "tp": 1, "dp": 1, "sp": 1, "ep": 1}
        for part in text.lower().replace("*", "x").split("x"):
            key, num = part[:2], part[2:]
            if key not in sizes or not num.isdigit() or int(num) < 1:
                raise ValueError(f"bad training layout {text!r}: expected factors like pp2, tp8, dp4, sp2, ep2 joined by 'x'")
            sizes[key] = int(num)
        return cls(**sizes)

    def coords(self, r: int) -> tuple[int, int, int]:
        """(pp_i, dp_i, tp_i) of rank r (tp innermost, then dp, then pp)."""
        return r // (self.dp * self.tp), (r // self.tp) % self.dp, r % self.tp

    def ep_coords(self, r: int) -> tuple[int, int]:
        """(edp index, ep index) of rank r: EP groups are ep consecutive dp ranks."""
        dp_i = self.coords(r)[1]
        return dp_i // self.ep, dp_i % self.ep

    def dispatch(self, r: int) -> tuple[int, int, bool]:
        """Rank r's training data split (dp index, dp size, collect?): the pp x tp ranks of a dp
        group share a chunk; the last stage's TP rank 0 returns the result. Under sp the sp
        consecutive dp ranks share a chunk and the first of them returns it."""
        pp_i, dp_i, tp_i = self.coords(r)
        return dp_i // self.sp, self.dp // self.sp, pp_i == self.pp - 1 and tp_i == 0 and dp_i % self.sp == 0

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split (dp / sp): mini- and micro-batches are per data rank."""
        return self.dp // self.sp

    @property
    def node_size(self) -> int:
        return self.procs_per_node or self.world

    def node(self, r: int) -> int:
        return r // self.node_size

    # ---- generation layout
    @property
    def gen_dp(self) -> int:
        return self.world // self.gen_tp

    def fits_gen_tp(self, gen_tp: int) -> bool:
        """Whether every generation slice of TP size `gen_tp` is made of whole training slices:
        gen_tp divides tp x dp, or is tp x dp times a divisor of pp."""
        m = self.tp * self.dp
        return m % gen_tp == 0 or (gen_tp % m == 0 and self.pp % (gen_tp // m) == 0)

    def gen_tp_choices(self) -> list[int]:
        return [g for g in divisors(self.world) if self.fits_gen_tp(g)]

    def gen_tp_problem(self, gen_tp: int, name: str = "gen_tp") -> str | None:
        """Why `gen_tp` does not fit this training layout (None when it does); `name` is what the
        message calls it (the validator: its config key)."""
        if self.fits_gen_tp(gen_tp):
            return None
        m = self.tp * self.dp
        return (f"{name} ({gen_tp}) does not fit the training layout pp{self.pp} x tp{self.tp} x dp{self.dp}: it must divide "
                f"tp x dp = {m} or be {m} times a divisor of pp, so that every generation slice is built from whole training "
                f"shards; set it to one of {self.gen_tp_choices()}")

    def gen_rank(self, r: int) -> tuple[int, int]:
        """(generation TP index, generation DP index) of rank r (module docstring)."""
        if self.consecutive:
            return r % self.gen_tp, r // self.gen_tp
        pp_i, dp_i, tp_i = self.coords(r)
        m, j = self.tp * self.dp, tp_i * self.dp + dp_i
        if m % self.gen_tp == 0:
            k = m // self.gen_tp
            return j // k, pp_i * k + j % k
        c = self.gen_tp // m  # gen_tp = c * m with c | pp
        return j * c + pp_i % c, pp_i // c


def gen_coords(layout: ParallelDims, gen_tp: int) -> list[tuple[int, int]]:
    """(generation TP index, generation DP index) per rank, HybridFlow's strided grouping."""
    dims = replace(layout, gen_tp=gen_tp, consecutive=False)
    return [dims.gen_rank(r) for r in range(dims.world)]


# The generation TP's rules with messages that name the config key (the validator's gen_tp check,
# registered in run_plan.py; parallel/tensor_parallel.py checks a model against them too).

def _heads_problems(key: str, size: int, heads: int, kv_heads: int, whose: str = "the model's", tail: str = "") -> list[str]:
    """A TP size must divide the attention and KV heads: each TP rank holds whole heads."""
    return [f"{key} ({size}) must divide {whose} {what} ({n}): each TP rank holds whole heads; set it to one of {divisors(n)}{tail}"
            for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)) if n and n % size]


def validate_gen_tp(gen_tp: int, world_size: int, num_attention_heads: int, num_key_value_heads: int) -> list[str]:
    """Problems with a generation TP size (empty when it is fine), each naming the key and the fix."""
    if not _size_ok(gen_tp):
        return [f"{TP_KEY} must be an integer >= 1, got {gen_tp!r}"]
    out = []
    if world_size % gen_tp:
        out.append(f"{TP_KEY} ({gen_tp}) must divide the number of actor workers ({world_size} = trainer.nnodes * "
                   f"trainer.n_gpus_per_node); set it to one of {divisors(world_size)}")
    out += _heads_problems(TP_KEY, gen_tp, num_attention_heads, num_key_value_heads, tail=f" (that also divides {world_size} workers)")
    return out
