"""ParallelDims (parallel/dims.py): the one layout object -- its rules, rank coordinates, and the
config checks it registers with the validator. Pure Python, no processes."""

from __future__ import annotations

import pytest

from hybridflow.hybrid_engine.plan import chunk_interval
from hybridflow.parallel.dims import ParallelDims, divisors, gen_coords


def _layouts(max_world: int = 12):
    for world in range(1, max_world + 1):
        for pp in divisors(world):
            for tp in divisors(world // pp):
                yield ParallelDims(pp, tp, world // (pp * tp))


def test_a_layout_parses_from_its_label_and_numbers_its_ranks():
    """The planner's label ("pp2xtp2xdp3", `hybridflow plan --train-layout`) and the trainer's
    for_world give the same object (one layout class since the TrainLayout alias went)."""
    d = ParallelDims.parse("pp2xtp2xdp3")
    assert (d.pp, d.tp, d.dp, d.world, d.label) == (2, 2, 3, 12, "pp2xtp2xdp3")
    assert ParallelDims.for_world(12, pp=2, tp=2) == d
    assert d.coords(7) == (1, 0, 1)  # 7 = (1 * 3 + 0) * 2 + 1: tp innermost, then dp, then pp
    assert [d.dispatch(r) for r in (6, 7, 11)] == [(0, 3, True), (0, 3, False), (2, 3, False)]


@pytest.mark.parametrize("kwargs, words", [
    (dict(dp=0), "dp must be an integer >= 1, got 0"),
    (dict(dp=4, gen_tp=3), "gen_tp (3) must divide the world size (4 = pp x tp x dp); set it to one of [1, 2, 4]"),
    (dict(pp=2, tp=3, gen_tp=2), "gen_tp (2) does not fit the training layout pp2 x tp3 x dp1: it must divide tp x dp = 3 or be 3 "
                                 "times a divisor of pp"),
    (dict(dp=4, procs_per_node=3), "procs_per_node (3) must divide the world size (4)"),
])
def test_a_layout_that_does_not_fit_is_refused_when_made(kwargs, words):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize("make, words", [
    # ParallelDims.for_world's own refusals (the rules of __post_init__ are the rows above)
    (lambda: ParallelDims.for_world(0, pp=1), "the world size, pp and tp must be integers >= 1, got 0, 1, 1"),
    (lambda: ParallelDims.for_world(4, tp=True), "the world size, pp and tp must be integers >= 1, got 4, 1, True"),
    (lambda: ParallelDims.for_world(6, pp=4), "pp x tp (4 x 1 = 4) must divide the world size 6"),
    # ParallelDims.parse (`hybridflow plan --layout`)
    (lambda: ParallelDims.parse("pp2xq3"), "bad training layout 'pp2xq3': expected factors like pp2, tp8, dp4"),
    (lambda: ParallelDims.parse("tp0xdp2"), "bad training layout 'tp0xdp2'"),
    # __post_init__: every size, procs_per_node included, is an integer >= 1
    (lambda: ParallelDims(dp=2, procs_per_node=0), "procs_per_node must be an integer >= 1, got 0"),
    (lambda: ParallelDims(dp=2, gen_tp=2.0), "gen_tp must be an integer >= 1, got 2.0"),
])
def test_every_other_layout_refusal(make, words):
    with pytest.raises(ValueError) as e:
        make()
    assert words in str(e.value)


def test_for_world_and_with_gen_check_too():
    with pytest.raises(ValueError, match=r"pp x tp \(4 x 1 = 4\) must divide the world size 6"):
        ParallelDims.for_world(6, pp=4)
    d = ParallelDims(pp=2, dp=2, procs_per_node=2)
    assert d.with_gen(4).gen_tp == 4 and d.with_gen(4).procs_per_node == 2  # gen_tp = tp*dp x a divisor of pp
    with pytest.raises(ValueError, match=r"gen_tp \(3\) must divide the world size \(4"):
        d.with_gen(3)
    with pytest.raises(ValueError, match=r"gen_tp \(2\) does not fit the training layout pp2 x tp3 x dp1"):
        ParallelDims(pp=2, tp=3).with_gen(2)  # divides the 6 ranks, but a generation slice would split a training shard
    assert d.with_gen(2, consecutive=True).consecutive and not d.with_gen(2, consecutive=True).with_gen(1, False).consecutive


def test_gen_rank_is_a_grid_and_nests_the_slices():
    """Every valid (layout, gen_tp): gen_rank is a bijection onto gen_tp x gen_dp; with the strided
    grouping the training slice (j of tp*dp) lies inside the generation slice (t of gen_tp) or the
    other way round (slices of a dim divisible by both, torch.chunk semantics)."""
    checked = 0
    for d in _layouts():
        for g in d.gen_tp_choices():
            for consecutive in (False, True):
                dims = d.with_gen(g, consecutive)
                coords = [dims.gen_rank(r) for r in range(d.world)]
                assert sorted(coords) == [(t, i) for t in range(g) for i in range(d.world // g)]
                if consecutive:
                    assert coords == [(r % g, r // g) for r in range(d.world)]
                    continue
                assert coords == gen_coords(d, g)
                m = d.tp * d.dp
                size = m * g
                for r, (t, _) in enumerate(coords):
                    pp_i, dp_i, tp_i = d.coords(r)
                    train = chunk_interval(size, m, tp_i * d.dp + dp_i)
                    gen = chunk_interval(size, g, t)
                    inner, outer = (train, gen) if g <= m else (gen, train)
                    assert outer[0] <= inner[0] and inner[1] <= outer[1], (d, g, r)
                checked += 1
    assert checked > 100


def test_the_fsdp_layout_groups_as_hybridflow():
    d = ParallelDims(dp=8).with_gen(2)
    assert [d.gen_rank(r) for r in range(8)] == [(r // 4, r % 4) for r in range(8)]  # micro-DP groups of 4 consecutive ranks


def test_the_validator_reaches_the_layout_checks_by_registration():
    """config.validate names the module in CHECK_MODULES; the module registers its checks on import."""
    from hybridflow.config import validate

    assert "hybridflow.run_plan" in validate.CHECK_MODULES  # the layout checks read the role sections: each role's spec checks itself
    assert validate.component_check("role_specs").__module__ == "hybridflow.run_plan"
    with pytest.raises(ValueError, match="unknown config check"):
        validate.register_check("no_such_check")
    with pytest.raises(ValueError, match="already registered"):
        validate.register_check("role_specs")(lambda *a: [])
