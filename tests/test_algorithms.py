"""Hand-computed checks of hybridflow.algorithms: advantages, PPO losses, KL estimators/controllers."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_adv_estimator,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
)

T = torch.tensor


def close(actual: torch.Tensor, expected: object, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=1e-5)


def whiten_by_hand(xs: list[float]) -> list[float]:
    """Reference whitening with the unbiased sample std (statistics.variance divides by n-1)."""
    mean, var = statistics.mean(xs), statistics.variance(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# ------------------------------------------------------------------ masked statistics
def test_masked_stats() -> None:
    x, mask = T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0])
    close(masked_mean(x, mask), 2.0)
    close(masked_var(x, mask), 1.0)  # ((-1)^2 + 0 + 1^2) / (3 - 1)
    close(masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(masked_whiten(x, mask)[:3], [-1.0, 0.0, 1.0])
    close(masked_whiten(x, mask, shift_mean=False)[:3], [1.0, 2.0, 3.0])
    m2 = T([[1.0, 2.0], [3.0, 4.0]])
    close(masked_mean(m2, T([[1.0, 0.0], [1.0, 1.0]]), dim=-1), [1.0, 3.5])
    close(masked_mean(x, torch.zeros(4)), 0.0)  # empty mask -> 0, not nan
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, T([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "mode, expected",
    [("token-mean", 7.0 / 3.0), ("seq-mean-token-sum", (3.0 + 4.0) / 2), ("seq-mean-token-mean", (1.5 + 4.0) / 2)],
)
def test_agg_loss_modes(mode: str, expected: float) -> None:
    loss_mat = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    close(agg_loss(loss_mat, mask, mode), expected)


def test_agg_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum")


# ------------------------------------------------------------------ advantage estimators
def test_registry() -> None:
    assert set(ADV_ESTIMATORS) >= {"gae", "grpo", "rloo", "reinforce_plus_plus", "remax"}
    with pytest.raises(KeyError, match="grpo"):
        get_adv_estimator("nope")


def test_gae_1x3_by_hand() -> None:
    # gamma=0.9, lam=0.8 (gamma*lam=0.72), V=[1,2,3], r=[0,0,1]; V after the end = 0.
    # t=2: delta = 1 + 0 - 3 = -2                    A2 = -2
    # t=1: delta = 0 + 0.9*3 - 2 = 0.7               A1 = 0.7 + 0.72*(-2) = -0.74
    # t=0: delta = 0 + 0.9*2 - 1 = 0.8               A0 = 0.8 + 0.72*(-0.74) = 0.2672
    adv, ret = get_adv_estimator("gae")(
        T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), values=T([[1.0, 2.0, 3.0]]), gamma=0.9, lam=0.8
    )
    close(ret, [[0.2672 + 1.0, -0.74 + 2.0, -2.0 + 3.0]])
    close(adv, [whiten_by_hand([0.2672, -0.74, -2.0])])


def test_gae_trailing_padding() -> None:
    # mask [1,1,0]; the padded value 99 must not leak in. gamma=lam=1.
    # t=1: delta = 1 + 0 - 2 = -1 -> A1 = -1;  t=0: delta = 0 + 2 - 1 = 1 -> A0 = 1 + (-1) = 0
    adv, ret = get_adv_estimator("gae")(
        T([[0.0, 1.0, 0.0]]), T([[1.0, 1.0, 0.0]]), values=T([[1.0, 2.0, 99.0]])
    )
    close(ret, [[1.0, 1.0, 0.0]])
    close(adv, [[*whiten_by_hand([0.0, -1.0]), 0.0]])  # = [0.7071, -0.7071, 0]


def test_gae_skips_inner_masked_token() -> None:
    # mask [1,0,1], gamma=0.5, lam=1: the masked middle token (value 50) is skipped, so V_next of
    # token 0 is V of token 2.  t=2: A2 = 1 - 2 = -1;  t=0: delta = 0 + 0.5*2 - 1 = 0,
    # A0 = 0 + 0.5*(-1) = -0.5.  returns = A + V = [0.5, (masked) 0, 1].
    _, ret = get_adv_estimator("gae")(
        T([[0.0, 0.0, 1.0]]), T([[1.0, 0.0, 1.0]]), values=T([[1.0, 50.0, 2.0]]), gamma=0.5
    )
    close(ret, [[0.5, 0.0, 1.0]])


GROUP_REWARDS = T([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 5.0]])  # scores 1, 0, 2 | 5
GROUP_MASK = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
GROUP_INDEX = np.array(["a", "a", "a", "b"], dtype=object)


def test_grpo_by_hand() -> None:
    # group a: mean 1, unbiased std sqrt((0 + 1 + 1)/2) = 1; group b has size 1 -> mean 0, std 1.
    adv, ret = get_adv_estimator("grpo")(GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX, epsilon=1e-6)
    s = 1.0 / (1.0 + 1e-6)
    close(adv, [[0.0, 0.0], [-s, 0.0], [s, s], [5 * s, 5 * s]])
    assert torch.equal(adv, ret)
    adv_nostd, _ = get_adv_estimator("grpo")(
        GROUP_REWARDS * 2, GROUP_MASK, index=GROUP_INDEX, norm_adv_by_std_in_grpo=False
    )
    close(adv_nostd, [[0.0, 0.0], [-2.0, 0.0], [2.0, 2.0], [10.0, 10.0]])  # scores 2,0,4 | 10


def test_rloo_by_hand() -> None:
    # leave-one-out: 1 - (0+2)/2 = 0;  0 - (1+2)/2 = -1.5;  2 - (1+0)/2 = 1.5;  lone b keeps 5.
    adv, ret = get_adv_estimator("rloo")(GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX)
    close(adv, [[0.0, 0.0], [-1.5, 0.0], [1.5, 1.5], [5.0, 5.0]])
    assert torch.equal(adv, ret)


def test_group_ids_can_be_ints_and_interleaved() -> None:
    adv, _ = get_adv_estimator("rloo")(T([[1.0], [3.0], [2.0], [6.0]]), torch.ones(4, 1), index=[7, 9, 7, 9])
    close(adv, [[-1.0], [-3.0], [1.0], [3.0]])


def test_reinforce_plus_plus_by_hand() -> None:
    # gamma=0.5. seq0: returns [0.25, 0.5, 1]. seq1: the reward 7 sits on a masked token and the
    # running return is reset there, so returns [0.5, 1, 0].
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    w = whiten_by_hand([0.25, 0.5, 1.0, 0.5, 1.0])
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]])


def test_remax_by_hand() -> None:
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator("remax")(rewards, mask, reward_baselines=T([0.5, 1.0]))
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    close(adv, [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "name, missing",
    [("gae", "values"), ("grpo", "index"), ("rloo", "index"), ("remax", "reward_baselines")],
)
def test_missing_inputs(name: str, missing: str) -> None:
    with pytest.raises(ValueError, match=missing):
        get_adv_estimator(name)(torch.zeros(2, 2), torch.ones(2, 2))


def test_uniform_signature() -> None:
    # The trainer passes every keyword to every estimator; all must accept them.
    kwargs = dict(
        index=np.array(["a", "a", "b", "b"], dtype=object),
        values=torch.rand(4, 3),
        reward_baselines=torch.zeros(4),
        teacher_log_prob=-torch.rand(4, 3),
        old_log_probs=-torch.rand(4, 3),
        gamma=1.0,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        epsilon=1e-6,
        extra_future_arg=1,
    )
    mask = T([[1.0, 1.0, 0.0]] * 4)
    for name, fn in ADV_ESTIMATORS.items():
        adv, ret = fn(torch.rand(4, 3), mask, **kwargs)
        assert adv.shape == ret.shape == (4, 3), name
        assert torch.all(adv[:, 2] == 0), name  # masked positions are zero


def test_on_policy_distill_advantage_is_teacher_minus_student_log_prob() -> None:
    fn = ADV_ESTIMATORS["on_policy_distill"]
    teacher = T([[-0.5, -2.0, -1.0], [-1.0, -0.1, -3.0]])
    student = T([[-1.0, -1.5, -1.0], [-0.2, -0.1, -9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = fn(torch.ones(2, 3), mask, teacher_log_prob=teacher, old_log_probs=student)  # the reward plays no part
    assert torch.allclose(adv, T([[0.5, -0.5, 0.0], [-0.8, 0.0, 0.0]])) and torch.equal(adv, ret)
    with pytest.raises(ValueError, match="teacher role"):
        fn(torch.ones(2, 3), mask, old_log_probs=student)


# ------------------------------------------------------------------ policy / value losses
def test_policy_loss_by_hand() -> None:
    # ratios [1.5, 0.5, 1.1, 5.0], advantages [1, 1, -1, -1], clip 0.2, dual clip c=3:
    # tok0 A>0 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)     tok1 A>0 r=0.5: max(-0.5, -0.8) = -0.5
    # tok2 A<0 r=1.1: max(1.1, 1.1) = 1.1, min(3, 1.1)    tok3 A<0 r=5: max(5, 1.2) = 5 -> min(3, 5) = 3
    ratios = T([[1.5, 0.5, 1.1, 5.0]])
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob=torch.zeros(1, 4),
        log_prob=ratios.log(),
        advantages=T([[1.0, 1.0, -1.0, -1.0]]),
        response_mask=torch.ones(1, 4),
    )
    close(loss, (-1.2 - 0.5 + 1.1 + 3.0) / 4)
    close(clipfrac, 0.25)
    close(clipfrac_lower, 0.25)
    close(ppo_kl, -math.log(1.5 * 0.5 * 1.1 * 5.0) / 4)


def test_policy_loss_clip_higher_asymmetry() -> None:
    # A=+1, r=1.25: clip_high=0.2 caps at 1.2 (loss -1.2); clip_high=0.28 leaves it (-1.25).
    # A=-1, r=0.7: lower bound 0.8 applies either way (loss max(0.7, 0.8) = 0.8).
    args = dict(old_log_prob=torch.zeros(1, 2), log_prob=T([[1.25, 0.7]]).log(), advantages=T([[1.0, -1.0]]),
                response_mask=torch.ones(1, 2), loss_agg_mode="seq-mean-token-sum")
    sym, sym_cf, _, _ = compute_policy_loss(**args, clip_ratio_low=0.2, clip_ratio_high=0.2)
    hi, hi_cf, _, _ = compute_policy_loss(**args, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(sym, -1.2 + 0.8)
    close(hi, -1.25 + 0.8)
    close(sym_cf, 1.0)
    close(hi_cf, 0.5)


def test_policy_loss_masked_and_zero_kl() -> None:
    lp = T([[-1.0, -2.0, -3.0]])
    loss, clipfrac, ppo_kl, lower = compute_policy_loss(lp, lp.clone(), T([[2.0, -1.0, 100.0]]), T([[1.0, 1.0, 0.0]]))
    close(ppo_kl, 0.0)
    close(loss, (-2.0 + 1.0) / 2)  # ratio 1: loss = -A on the two valid tokens; the masked 100 is ignored
    close(clipfrac, 0.0)
    close(lower, 0.0)
    with pytest.raises(AssertionError):
        compute_policy_loss(lp, lp, lp, lp, clip_ratio_c=1.0)


def test_value_loss_by_hand() -> None:
    # old values 0, cliprange 0.5:
    # tok0 v=1, R=2:    unclipped (1-2)^2 = 1,     clipped (0.5-2)^2 = 2.25 -> 2.25 (clipped)
    # tok1 v=-0.3, R=0: inside the range, both 0.09                         -> 0.09
    # tok2 v=1, R=-1:   unclipped 4,               clipped (0.5+1)^2 = 2.25 -> 4
    vf_loss, clipfrac = compute_value_loss(
        vpreds=T([[1.0, -0.3, 1.0]]), returns=T([[2.0, 0.0, -1.0]]), values=torch.zeros(1, 3),
        response_mask=torch.ones(1, 3), cliprange_value=0.5,
    )
    close(vf_loss, 0.5 * (2.25 + 0.09 + 4.0) / 3)
    close(clipfrac, 1.0 / 3.0)


def test_entropy_and_logprobs() -> None:
    close(entropy_from_logits(torch.zeros(2, 3, 5)), torch.full((2, 3), math.log(5)))
    logits = T([[[0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    close(entropy_from_logits(logits), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    close(logprobs_from_logits(logits, T([[1]])), [[math.log(0.75)]])
    g = torch.Generator().manual_seed(0)
    big = torch.randn(2, 3, 7, generator=g)
    labels = torch.randint(0, 7, (2, 3), generator=g)
    manual = torch.stack([torch.stack([big[b, t].softmax(-1)[labels[b, t]].log() for t in range(3)]) for b in range(2)])
    close(logprobs_from_logits(big, labels), manual)
    out = logprobs_from_logits(big.bfloat16(), labels)
    assert out.dtype == torch.float32


# ------------------------------------------------------------------ KL
LP, REF = T([[0.0, -1.0]]), T([[-1.0, 0.0]])  # lp - ref = [1, -1]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), [[1.0, -1.0]]),
        (("k2", "mse"), [[0.5, 0.5]]),
        (("k3", "low_var_kl"), [[math.exp(-1.0), math.e - 2.0]]),  # exp(r) - r - 1 with r = ref - lp
        (("abs",), [[1.0, 1.0]]),
    ],
)
def test_kl_kinds(kinds: tuple[str, ...], expected: list[list[float]]) -> None:
    for kind in kinds:
        close(kl_penalty(LP, REF, kind), expected)


def test_kl_k3_clamped_and_unknown() -> None:
    close(kl_penalty(T([[0.0, 30.0]]), T([[20.0, 0.0]]), "low_var_kl"), [[10.0, 10.0]])
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LP, REF, "k4")
    assert set(KL_ESTIMATORS) == {"k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"}


def test_kl_loss() -> None:
    mask = torch.ones(1, 2)
    close(kl_loss(LP, REF, mask, "k1", "token-mean"), 0.0)
    close(kl_loss(LP, REF, mask, "abs", "seq-mean-token-sum"), 2.0)
    close(kl_loss(LP, REF, mask, "low_var_kl", "token-mean"), (math.exp(-1.0) + math.e - 2.0) / 2)


def test_kl_controllers() -> None:
    fixed = FixedKLController(0.3)
    fixed.update(current_kl=5.0, n_steps=100)
    assert fixed.value == 0.3
    ada = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ada.update(current_kl=0.1, n_steps=10)  # error clip(2 - 1) = 0.2 -> x(1 + 0.2*10/100) = 1.02
    assert ada.value == pytest.approx(0.102)
    ada.update(current_kl=0.045, n_steps=50)  # error 0.9 - 1 = -0.1 -> x(1 - 0.1*50/100) = 0.95
    assert ada.value == pytest.approx(0.102 * 0.95)
    restored = AdaptiveKLController(1.0, 1.0, 1)
    restored.load_state_dict(ada.state_dict())
    assert restored.state_dict() == ada.state_dict()
    f2 = FixedKLController(0.0)
    f2.load_state_dict(fixed.state_dict())
    assert f2.value == 0.3
    assert isinstance(make_kl_controller("fixed", 0.1, 0.1, 10), FixedKLController)
    made = make_kl_controller("adaptive", 0.2, target_kl=0.1, horizon=10)
    assert isinstance(made, AdaptiveKLController) and made.value == 0.2
    with pytest.raises(ValueError, match="adaptive"):
        make_kl_controller("pid", 0.1, 0.1, 10)


def test_apply_kl_penalty_by_hand() -> None:
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    log_prob = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # k1 kl masked = [[.1,.2,.3],[.4,0,0]]; beta 0.5; per-seq mean kl = 0.2, 0.4 -> batch 0.3
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, log_prob, torch.zeros(2, 3), mask, ctrl, kind="kl")
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 2.0, 0.0]])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.3)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # the beta that was applied
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))  # updated with n_steps = B = 2


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_of_equal_fractional_scores_gets_zero_advantage(estimator):
    # eight samples scoring 0.7 (float32): the group statistics in float64 give exactly 0, where
    # float32 left a ~1e-8 std that (score - mean) / (std + eps) blew up to about +-0.06
    rewards = torch.zeros(16, 3)
    rewards[:8, -1] = 0.7
    rewards[8:, -1] = torch.tensor([0.1, 0.9, 0.3, 0.7, 0.2, 0.4, 0.6, 0.8])
    index = np.array(["a"] * 8 + ["b"] * 8, dtype=object)
    adv, _ = get_adv_estimator(estimator)(rewards, torch.ones(16, 3), index=index)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:8], torch.zeros(8, 3))
    assert adv[8:].abs().max() > 0.1


def test_policy_losses_are_registered_by_name():
    from hybridflow.algorithms import POLICY_LOSSES, get_policy_loss, register_policy_loss
    from hybridflow.config import ConfigError, load_config, validate_config

    torch.manual_seed(0)
    old, new, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    mask = (torch.rand(3, 5) > 0.3).float()
    loss, metrics = get_policy_loss("vanilla")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                               loss_agg_mode="seq-mean-token-mean", unused_by_this_loss=1)
    want = compute_policy_loss(old, new, adv, mask, 0.2, 0.28, 3.0, "seq-mean-token-mean")
    assert torch.equal(loss, want[0]) and [metrics[k] for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")] == list(want[1:])
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'.*registered: \['cispo', 'gspo', 'vanilla'"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)

    # the config key is validated against the registry (a new loss is one registered function)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.policy_loss\.loss_mode must be one of .*'vanilla'.*got 'reinforce'"):
        validate_config(load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=reinforce", "actor_rollout_ref.model.path=x"]))

    @register_policy_loss("reinforce")
    def reinforce(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", **_):
        return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), {}

    try:
        problems = ""
        try:
            validate_config(load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=reinforce", "actor_rollout_ref.model.path=x"]))
        except ConfigError as e:
            problems = str(e)
        assert "policy_loss" not in problems, problems
    finally:
        POLICY_LOSSES.pop("reinforce")


# ---------------------------------------------------------------- GSPO, CISPO, Dr. GRPO (values by hand)
def test_gspo_ratio_is_the_exp_of_the_mean_token_log_ratio_and_clips_per_sequence():
    from hybridflow.algorithms import get_policy_loss

    old = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -0.5, 0.0]])
    new = torch.tensor([[-0.9, -1.8, -1.5], [-0.5, -0.9, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    loss, m = get_policy_loss("gspo")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.05, loss_agg_mode="token-mean")
    # sequence 0: mean log-ratio (0.1 + 0.2 + 0) / 3 = 0.1 -> s = e^0.1 = 1.10517 > 1.05: clipped, A > 0 -> -1.05 per token
    # sequence 1: (0 - 0.4) / 2 = -0.2 -> s = e^-0.2 = 0.81873 (inside [0.8, 1.05]) -> 2 * 0.81873 per token
    s1 = math.exp(-0.2)
    assert loss.item() == pytest.approx((-1.05 + 2 * s1) / 2, abs=1e-6)  # seq-mean-token-mean whatever loss_agg_mode says
    assert m["pg_clipfrac"].item() == pytest.approx(3 / 5)  # sequence 0's three tokens
    loss.backward()
    # clipped sequence: no gradient; sequence 1: d/d new_t of mean_t(2 s) = 2 s / 2 per valid token
    assert torch.equal(new.grad[0], torch.zeros(3))
    assert new.grad[1].tolist() == pytest.approx([s1 / 2 * 2 / 2, s1 / 2 * 2 / 2, 0.0], abs=1e-6)


def test_cispo_weight_is_clipped_and_detached_so_the_gradient_is_through_log_prob_only():
    from hybridflow.algorithms import get_policy_loss

    old = torch.tensor([[-1.0, -1.0, -1.0]])
    new = torch.tensor([[-0.5, -1.0, -3.0]], requires_grad=True)  # ratios e^0.5 = 1.6487, 1, e^-2 = 0.1353
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, m = get_policy_loss("cispo")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    w = [1.28, 1.0, 0.8]  # clipped to [0.8, 1.28]; PPO would zero the first token's gradient, CISPO keeps it at the cap
    assert loss.item() == pytest.approx(-sum(2 * wi * x for wi, x in zip(w, [-0.5, -1.0, -3.0])) / 3, abs=1e-6)
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-2 * wi / 3 for wi in w], abs=1e-6)  # -A * w / n: no ratio derivative
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_dr_grpo_sums_tokens_over_a_constant_and_leaves_advantages_unscaled():
    from hybridflow.algorithms import agg_loss, get_adv_estimator

    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # per-sequence sums 6 and 4, over T = 4, averaged over the 2 sequences: (1.5 + 1.0) / 2
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.25)
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one group of 4: mean 0.25
    import numpy as np

    adv, _ = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=torch.ones(4, 2), index=np.zeros(4, dtype=object),
                                       norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])  # r - mean, no division by the std (0.5)


# ---------------------------------------------------------------- the optimizer's schedule and clipping (by hand)
def test_warmup_then_cosine_lr_per_step_by_hand():
    from hybridflow.config.schema import OptimConfig
    from hybridflow.engine.optim import build_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1e-3)
    sched = build_scheduler(opt, OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1), total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup: step s < 2 -> lr * s / 2; then lr * (0.1 + 0.9 * (1 + cos(pi * (s - 2) / 8)) / 2)
    want = [1e-3 * s / 2 for s in range(2)] + [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8))) for s in range(2, 10)]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-12)
    const = torch.optim.SGD([p], lr=1e-3)
    sched = build_scheduler(const, OptimConfig(lr=1e-3, lr_warmup_steps=4), total_steps=10)
    seen = []
    for _ in range(6):
        seen.append(const.param_groups[0]["lr"])
        const.step()
        sched.step()
    assert seen == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_the_schedules_give_transformers_learning_rates_bit_for_bit():
    """engine/optim.py writes transformers' two schedules out (to keep peft out of worker imports):
    the learning rates of a 700-step run must be the very floats transformers' own give."""
    from transformers import get_scheduler

    from hybridflow.config.schema import OptimConfig
    from hybridflow.engine.optim import build_scheduler

    def lrs(make) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
        sched, out = make(opt), []
        for _ in range(720):  # past the end of the cosine
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    cosine = OptimConfig(lr=2e-3, lr_scheduler_type="cosine", lr_warmup_steps_ratio=0.05, min_lr_ratio=0.1)
    assert lrs(lambda o: build_scheduler(o, cosine, 700)) == lrs(lambda o: get_scheduler(
        "cosine_with_min_lr", o, num_warmup_steps=35, num_training_steps=700, scheduler_specific_kwargs={"min_lr_rate": 0.1}))
    assert lrs(lambda o: build_scheduler(o, OptimConfig(lr=2e-3, lr_warmup_steps=7), 700)) == lrs(
        lambda o: get_scheduler("constant_with_warmup", o, num_warmup_steps=7))


def test_the_fused_adamw_step_is_adamw_by_hand():
    """build_optimizer runs PyTorch's fused AdamW on CPU; three steps of it against AdamW written out
    in float64 (decoupled weight decay, bias-corrected moments). Parameters are O(1-4): fp32 spacing
    there is <= 4.8e-7 and three steps round a few times, so 5e-6; a wrong formula (no bias
    correction, no decay) moves a value by ~1e-3 (lr x decay x value) or more."""
    from hybridflow.config.schema import OptimConfig
    from hybridflow.engine.optim import build_optimizer

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 300)]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95])
    opt = build_optimizer(params, cfg)
    assert opt.param_groups[0]["fused"] is True
    want = [p.detach().double().clone() for p in params]
    m, v = [torch.zeros_like(w) for w in want], [torch.zeros_like(w) for w in want]
    b1, b2, eps = 0.9, 0.95, 1e-8
    for t, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(step_grads):
            g = g.double()
            want[i] *= 1 - cfg.lr * cfg.weight_decay
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            want[i] -= cfg.lr * (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=5e-6)


def test_grad_clip_clips_to_the_limit_and_reports_the_norm_before():
    from hybridflow.engine.optim import clip_and_step

    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    model.weight.grad = torch.tensor([[3.0, 4.0, 12.0]])  # norm 13
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    assert clip_and_step(model, opt, grad_clip=1.0) == pytest.approx(13.0)
    # the step moved the weights by exactly the clipped gradient: norm 1, direction kept
    assert model.weight.detach()[0].tolist() == pytest.approx([-3 / 13, -4 / 13, -12 / 13])
    assert model.weight.grad is None
    model.weight.grad = torch.tensor([[0.3, 0.4, 0.0]])  # under the limit: unchanged
    before = model.weight.detach().clone()
    assert clip_and_step(model, opt, grad_clip=1.0) == pytest.approx(0.5)
    assert (before - model.weight.detach())[0].tolist() == pytest.approx([0.3, 0.4, 0.0])


def test_the_entropy_bonus_and_kl_terms_of_the_actor_loss_by_hand():
    """loss = pg - entropy_coeff * agg(entropy) + kl_coef * agg(kl): d loss / d entropy_t = -coeff / n_valid (token-mean)."""
    from hybridflow.algorithms import get_policy_loss
    from hybridflow.algorithms.actor_loss import ppo_actor_loss

    log_prob = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    entropy = torch.tensor([[0.7, 0.2, 0.9]], requires_grad=True)
    mb = {"response_mask": torch.tensor([[1.0, 1.0, 0.0]]), "advantages": torch.tensor([[1.0, 1.0, 1.0]]),
          "old_log_probs": torch.tensor([[-1.0, -2.0, -0.5]]), "ref_log_prob": torch.tensor([[-1.5, -2.0, 0.0]])}
    common = dict(policy_loss=get_policy_loss("vanilla"), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    base, _ = ppo_actor_loss(log_prob, entropy, mb, **common)
    loss, parts = ppo_actor_loss(log_prob, entropy, mb, **common, entropy_coeff=0.1, use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.5)
    assert parts["entropy"].item() == pytest.approx((0.7 + 0.2) / 2)
    assert parts["kl_loss"].item() == pytest.approx((0.5 + 0.0) / 2)  # k1 = log_prob - ref over the 2 valid tokens
    assert loss.item() == pytest.approx(base.item() - 0.1 * 0.45 + 0.5 * 0.25)
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])  # -coeff / 2 valid tokens; the padded one none
    # ratio 1: d pg / d log_prob_t = -A / 2; d kl / d log_prob_t = 0.5 / 2
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5 + 0.25, -0.5 + 0.25, 0.0])


def test_dapo_overlong_penalty_at_the_buffers_start_middle_and_end():
    from hybridflow.config.schema import OverlongBufferConfig, RewardModelConfig
    from hybridflow.protocol import Batch
    from hybridflow.trainer.driver_stages import overlong_penalty, reward

    # max 20 tokens, buffer 8: no penalty up to 12; 16 is half-way (-0.5 * factor); 20 the end (-factor)
    lengths = torch.tensor([10, 12, 16, 20])
    assert overlong_penalty(lengths, 20, 8, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 8, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]
    # in the reward stage: added on each response's last token
    mask = torch.zeros(4, 20)
    for i, n in enumerate(lengths.tolist()):
        mask[i, :n] = 1
    rm = RewardModelConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0))
    out = reward(Batch.from_dict(tensors={"response_mask": mask}), lambda b: (torch.ones(4, 20) * 0.0, {}), rm, False, max_response_length=20)
    scores = out["token_level_scores"]
    assert [scores[i, n - 1].item() for i, n in enumerate(lengths.tolist())] == [0.0, 0.0, -0.5, -1.0]
    assert scores.sum().item() == -1.5 and out.meta["metrics"]["reward/overlong_penalty/mean"] == -0.375
    assert "reward/overlong_frac" not in out.meta["metrics"]
    rm.overlong_buffer.log = True  # verl's key: the per-sample detail as well (2 of 4 cut, the worst by the whole factor)
    logged = reward(Batch.from_dict(tensors={"response_mask": mask}), lambda b: (torch.zeros(4, 20), {}), rm, False, max_response_length=20)
    assert (logged.meta["metrics"]["reward/overlong_frac"], logged.meta["metrics"]["reward/overlong_penalty/min"]) == (0.5, -1.0)


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample():
    import itertools

    from hybridflow.trainer.validation import pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute), (n, c, k)
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 0, 4) == 0.0


def test_validation_reports_mean_best_and_pass_at_k_over_n_samples():
    """val_kwargs.n = 4 samples per prompt: prompt A solved by 1 of its 4 samples, prompt B by none."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.protocol import Batch
    from hybridflow.trainer.keys import SAMPLE_INFO_KEYS
    from hybridflow.trainer.validation import validate

    cfg = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.n=4", "data.val_batch_size=2"], schema=HybridFlowConfig)
    rows = [{"prompt_id": 0}, {"prompt_id": 1}]

    def collate(items):
        n = len(items)
        return Batch.from_dict(tensors={"prompt_id": torch.tensor([r["prompt_id"] for r in items])},
                               non_tensors={k: ["src"] * n if k == "data_source" else [None] * n for k in SAMPLE_INFO_KEYS})

    def generate(batch, params):  # sample j of prompt 0 scores 1 when j == 2; prompt 1 never
        solved = [float(p == 0 and j % 4 == 2) for j, p in enumerate(batch["prompt_id"].tolist())]
        return Batch.from_dict(tensors={"solved": torch.tensor(solved), "response_mask": torch.ones(len(solved), 3)})

    def reward_fn(batch):
        scores = torch.zeros(len(batch), 3)
        scores[:, -1] = batch["solved"]
        return scores, {}

    out = validate(cfg.actor_rollout_ref.rollout.val_kwargs, cfg.data.val_batch_size, rows, collate, generate, reward_fn, None)
    assert out["val-core/src/acc/mean@4"] == pytest.approx(1 / 8)
    # best@k is bootstrapped (k of the 4 samples with replacement, 1000 draws): prompt A's expected
    # best is 1 - (3/4)^k, prompt B's 0; 1000 draws of a 0/1 max have a standard error <= 0.016.
    for k in (2, 4):
        assert out[f"val-{'core' if k == 4 else 'aux'}/src/acc/best@{k}/mean"] == pytest.approx((1 - 0.75**k) / 2, abs=0.03)
    assert "val-core/src/acc/maj@4/mean" not in out  # no scorer answer to vote on
    # prompt A: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; prompt B: 0
    assert [out[f"val-core/src/acc/pass@{k}"] for k in (1, 2, 4)] == pytest.approx([1 / 8, 1 / 4, 1 / 2])


def test_majority_vote_by_hand():
    from hybridflow.trainer.validation import majority_value

    assert majority_value(["7", "8", "7", None], [1.0, 0.0, 1.0, 0.0]) == 1.0  # "7" twice
    assert majority_value(["8", "7", "7", "8"], [0.0, 1.0, 1.0, 0.0]) == 0.0  # a tie: the answer seen first
    assert majority_value([None, None, "9"], [1.0, 1.0, 0.0]) == 0.0  # samples without an answer do not vote
    assert majority_value([None, None], [1.0, 1.0]) == 0.0


def test_bootstrapped_maj_and_best_match_exact_expectations():
    """maj@4 and best@4 drawn 1000 times agree with the exact expectation over all 4^4 equally
    likely draws (brute force), within four standard errors."""
    import itertools

    from hybridflow.trainer.validation import sample_metrics

    preds, scores = ["a", "b", "a", "c"], [1.0, 0.0, 1.0, 0.0]  # the right answer "a" twice
    m = sample_metrics(scores, preds)

    def maj(draw):  # independent of the implementation: count votes, first-seen wins a tie
        counts: dict = {}
        for i in draw:
            counts[preds[i]] = counts.get(preds[i], 0) + 1
        best = max(counts.values())
        return scores[next(i for i in draw if counts[preds[i]] == best)]

    draws = list(itertools.product(range(4), repeat=4))
    exact_maj = sum(maj(d) for d in draws) / len(draws)
    exact_best = 1 - 0.5**4
    assert m["mean@4"] == 0.5 and m["pass@1"] == 0.5 and m["pass@2"] == pytest.approx(1 - 1 / 6)
    assert m["maj@4/mean"] == pytest.approx(exact_maj, abs=4 * m["maj@4/std"] / 1000**0.5)
    assert m["best@4/mean"] == pytest.approx(exact_best, abs=4 * m["best@4/std"] / 1000**0.5)
    assert sample_metrics(scores, preds) == m  # seeded: the same numbers every run


# ------------------------------------------------------------------ rollout correction
def _corr(**kw):
    from hybridflow.algorithms.rollout_correction import Correction

    return Correction(**kw)


def test_rollout_correction_weights_by_hand():
    """d = old - rollout log-prob per token; two sequences of 3 tokens, the second with 2 valid."""
    from hybridflow.algorithms.rollout_correction import correction_weights

    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    old = torch.tensor([[-1.0 + math.log(3.0), -2.0 + math.log(0.5), -0.5], [-1.0 + math.log(1.5), -1.0 + math.log(1.2), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # token IS, threshold 2: ratios 3 -> 2 (clipped), 0.5, 1 | 1.5, 1.2, padding 0
    w, keep, m = correction_weights(old, rollout, mask, _corr(rollout_is="token", is_threshold=2.0))
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.2, 0.0]]))
    assert torch.equal(keep, mask.float())
    assert m["rollout_corr/is_clipped_frac"] == pytest.approx(1 / 5) and m["rollout_corr/is_weight_max"] == pytest.approx(2.0)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5 + 1.2) / 5)
    # sequence IS: products 3 * 0.5 * 1 = 1.5 and 1.5 * 1.2 = 1.8, both under 2; threshold 1.6 clips the second
    w, _, m = correction_weights(old, rollout, mask, _corr(rollout_is="sequence", is_threshold=1.6))
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 1.5], [1.6, 1.6, 0.0]]))
    assert m["rollout_corr/is_clipped_frac"] == pytest.approx(1 / 2)
    # token RS in [0.6, 2.5]: drops the 3 and the 0.5
    _, keep, m = correction_weights(old, rollout, mask, _corr(rollout_rs="token", rs_upper=2.5, rs_lower=0.6))
    assert torch.equal(keep, torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]))
    assert m["rollout_corr/rs_masked_frac"] == pytest.approx(2 / 5) and m["rollout_corr/kept_token_frac"] == pytest.approx(3 / 5)
    # sequence RS in [0.5, 1.6]: 1.5 stays, 1.8 goes
    _, keep, _ = correction_weights(old, rollout, mask, _corr(rollout_rs="sequence", rs_upper=1.6, rs_lower=0.5))
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    # geometric RS: (1.5)^(1/3) = 1.1447 and (1.8)^(1/2) = 1.3416; upper 1.2 keeps the first only
    _, keep, _ = correction_weights(old, rollout, mask, _corr(rollout_rs="geometric", rs_upper=1.2, rs_lower=1 / 1.2))
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    # veto 0.6: the first sequence has a 0.5 token -> dropped whole
    _, keep, m = correction_weights(old, rollout, mask, _corr(veto_threshold=0.6))
    assert torch.equal(keep, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])) and m["rollout_corr/veto_frac"] == 0.5


def test_rollout_correction_is_exactly_one_for_identical_policies():
    from hybridflow.algorithms.rollout_correction import correction_weights

    lp = -torch.rand(4, 6) * 3
    mask = (torch.arange(6)[None, :] < torch.tensor([[6], [3], [1], [5]])).long()
    for c in (_corr(rollout_is="token"), _corr(rollout_is="sequence", rollout_rs="geometric", rs_upper=1.0001, rs_lower=0.9999, veto_threshold=1e-4)):
        w, keep, m = correction_weights(lp, lp.clone(), mask, c)
        assert torch.equal(w, mask.float()) and torch.equal(keep, mask.float())
        assert m["rollout_corr/is_weight_mean"] == 1.0 and m["rollout_corr/kept_token_frac"] == 1.0


def test_rollout_correction_changes_the_update_of_a_stale_rollout():
    """A stale rollout (the behaviour policy gave token 0 three times the old policy's probability):
    the gradient of the corrected loss is the plain one scaled per token by the hand weights, and
    with the weights all 1 it is the plain gradient exactly."""
    from hybridflow.algorithms import get_policy_loss
    from hybridflow.algorithms.actor_loss import ppo_actor_loss
    from hybridflow.algorithms.rollout_correction import correction_weights

    old = torch.tensor([[-1.0, -2.0, -0.7]])
    rollout = old - torch.tensor([[math.log(1 / 3), 0.0, math.log(1.5)]])  # old / rollout = 1/3, 1, 1.5
    mask, adv = torch.ones(1, 3), torch.tensor([[1.0, -1.0, 2.0]])
    kw = dict(policy_loss=get_policy_loss("vanilla"), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")

    def grad(extra):
        lp = old.clone().requires_grad_(True)
        loss, _ = ppo_actor_loss(lp, torch.zeros(1, 3), {"old_log_probs": old, "advantages": adv, "response_mask": mask, **extra}, **kw)
        loss.backward()
        return lp.grad

    w, keep, _ = correction_weights(old, rollout, mask, _corr(rollout_is="token", is_threshold=2.0))
    assert torch.allclose(w, torch.tensor([[1 / 3, 1.0, 1.5]]))
    plain, corrected = grad({}), grad({"rollout_is_weights": w, "rollout_rs_mask": keep})
    assert torch.allclose(plain, -adv / 3)  # at ratio 1: d(-A r)/d lp = -A r = -A, over 3 tokens
    assert torch.allclose(corrected, plain * w) and not torch.allclose(corrected, plain)
    assert torch.equal(grad({"rollout_is_weights": torch.ones(1, 3), "rollout_rs_mask": torch.ones(1, 3)}), plain)
    # a rejected token leaves the mean's denominator: token 0 masked -> the other two over 2 tokens
    masked = grad({"rollout_rs_mask": torch.tensor([[0.0, 1.0, 1.0]])})
    assert torch.allclose(masked, torch.tensor([[0.0, 1 / 2, -2 / 2]]))


# ------------------------------------------------------------------ dynamic sampling
def test_varied_groups_keeps_groups_with_different_rewards():
    from hybridflow.trainer.driver_stages import varied_groups

    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert varied_groups(values, uids).tolist() == [2, 3, 6, 7]
    assert varied_groups(torch.ones(4), ["a", "a", "b", "b"]).tolist() == []


def test_dynamic_sampling_compares_the_metric_it_is_told():
    from hybridflow.protocol import Batch
    from hybridflow.trainer.driver_stages import group_values, varied_groups

    # 2 groups x 2 samples. The rule's scores differ in group 0 only by partial credit (0.5 vs 1.0) but its "acc"
    # is 1 for both; an overlong penalty (-0.2 on row 3) makes group 1's sequence rewards differ, not its scores.
    seq = torch.tensor([[0.0, 0.5], [0.0, 1.0], [0.0, 0.0], [0.0, -0.2]])  # token_level_scores [B, 2]
    batch = Batch.from_dict(tensors={"token_level_scores": seq})
    scores, extras, uids = [0.5, 1.0, 0.0, 0.0], {"acc": [1.0, 1.0, 0.0, 0.0]}, ["a", "a", "b", "b"]
    kept = {m: varied_groups(group_values(batch, m, scores, extras), uids).tolist() for m in ("acc", "score", "seq_reward", "seq_final_reward")}
    assert kept == {"acc": [], "score": [0, 1], "seq_reward": [0, 1, 2, 3], "seq_final_reward": [0, 1, 2, 3]}
    # no per-sample acc from the reward function: acc is its score; only a reward model scored: the sequence sums
    assert varied_groups(group_values(batch, "acc", scores, {}), uids).tolist() == [0, 1]
    assert varied_groups(group_values(batch, "acc", None, {}), uids).tolist() == [0, 1, 2, 3]


def _dynamic_trainer(rewards_per_round: list[list[float]], max_rounds: int, prompts: int = 2, dp: int = 2, strict: bool = False):
    """An RLTrainer with only what `_sample_groups` reads: `prompts` prompts x 2 samples per step on
    an actor of `dp` data-parallel ranks; the sampling flow's reward stage hands out the next round's scores."""
    from hybridflow.config import load_config
    from hybridflow.config.schema import HybridFlowConfig
    from hybridflow.protocol import Batch
    from hybridflow.trainer.dataflow import DataFlow, Stage
    from hybridflow.run_plan import resolve
    from hybridflow.trainer.rl import RLTrainer

    t = RLTrainer.__new__(RLTrainer)
    t.cfg = load_config(None, [f"data.train_batch_size={prompts}", "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true",
                               f"algorithm.filter_groups.max_num_gen_batches={max_rounds}", f"algorithm.filter_groups.strict={str(strict).lower()}"],
                        schema=HybridFlowConfig)
    t.run_plan = resolve(t.cfg)
    t._gen_round, t.drawn, t.slept, t.global_step, t.underfilled_batches, t.critic = 0, 0, 0, 1, 0, None
    t.roles = type("Roles", (), {"use_rm": False})()
    t.reward_fn = type("Rule", (), {"last_scores": [], "last_extras": {}})()  # the fake reward stage below bypasses it
    t.actor = type("Actor", (), {"world_size": dp, "sleep_rollout": lambda self: setattr(t, "slept", t.slept + 1)})()
    rounds = iter(rewards_per_round)

    def prepare():
        t.drawn += 1
        rows = [10 * t.drawn + i for i in range(prompts) for _ in range(2)]  # prompt ids, 2 samples each
        return Batch.from_dict(tensors={"prompt": torch.tensor(rows)}, non_tensors={"uid": [f"{t.drawn}-{r}" for r in rows]})

    def gen(b):
        return Batch.from_dict(tensors={"seed_round": torch.full((len(b),), t._gen_round)})

    def reward(b):
        return Batch.from_dict(tensors={"token_level_scores": torch.tensor(next(rounds))[:, None] * torch.ones(1, 3)})

    t._prepare_batch = prepare
    t.sample_flow = DataFlow([Stage("gen", gen, ["prompt"], ["seed_round"]), Stage("reward", reward, ["seed_round"], ["token_level_scores"])])
    return t, prepare


def test_dynamic_sampling_drops_flat_groups_and_refills_the_batch():
    # round 1: group 0 all 1 (dropped), group 1 varied; round 2: both flat; round 3: group 0 varied
    t, prepare = _dynamic_trainer([[1, 1, 0, 1], [0, 0, 1, 1], [1, 0, 0, 0]], max_rounds=5)
    batch, metrics = t._sample_groups(prepare())
    assert batch["prompt"].tolist() == [11, 11, 30, 30]  # prompt 1 of round 1, prompt 0 of round 3
    assert batch["seed_round"].tolist() == [0, 0, 2, 2]  # each round sampled with its own seed
    assert metrics["data/num_gen_batches"] == 3.0 and metrics["data/kept_groups_frac"] == pytest.approx(4 / 12)
    assert metrics["data/train_groups"] == 2.0 and metrics["data/underfilled_batches"] == 0.0  # a full batch
    assert t._gen_round == 0 and "timing_s/gen" in metrics and t.slept == 1  # generation memory freed once, after the rounds


def test_dynamic_sampling_strict_stops_at_the_limit_naming_the_key():
    t, prepare = _dynamic_trainer([[1, 1, 0, 1], [0, 0, 1, 1]], max_rounds=2, strict=True)
    with pytest.raises(RuntimeError) as e:
        t._sample_groups(prepare())
    msg = str(e.value)
    assert "kept 1 of the 2 groups" in msg and "2 generation rounds" in msg and "algorithm.filter_groups.max_num_gen_batches" in msg
    assert "algorithm.filter_groups.strict=true stops the run" in msg and "Set algorithm.filter_groups.strict=false to train" in msg
    assert t._gen_round == 0 and t.slept == 1


def test_dynamic_sampling_that_cannot_fill_the_batch_trains_on_the_groups_kept(caplog):
    """Not strict (the default): after max_num_gen_batches rounds the step gets the groups kept,
    a warning, and the running count data/underfilled_batches."""
    t, prepare = _dynamic_trainer([[1, 1, 0, 1], [0, 0, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]], max_rounds=2)
    with caplog.at_level("WARNING", logger="hybridflow"):
        batch, metrics = t._sample_groups(prepare())
        assert batch["prompt"].tolist() == [11, 11]  # the one varied group of the two rounds
        assert (metrics["data/train_groups"], metrics["data/underfilled_batches"], metrics["data/num_gen_batches"]) == (1.0, 1.0, 2.0)
        t.global_step = 2
        batch, metrics = t._sample_groups(prepare())  # the next step: one varied group in round 1, none in round 2
        assert batch["prompt"].tolist() == [30, 30] and metrics["data/underfilled_batches"] == 2.0  # a running count
    warnings = [r.getMessage() for r in caplog.records if "dynamic sampling kept" in r.getMessage()]
    assert len(warnings) == 2 and "step 1: dynamic sampling kept 1 of the 2 groups a step needs after 2 generation rounds" in warnings[0]
    assert "training on 1 group (2 sequences)" in warnings[0] and "algorithm.filter_groups.strict=true stops instead" in warnings[0]


def test_an_underfilled_batch_drops_the_fewest_groups_so_it_splits_over_the_data_parallel_ranks(caplog):
    # 4 prompts x 2 samples over 4 data-parallel ranks: rows come in multiples of 4, i.e. groups in pairs
    t, prepare = _dynamic_trainer([[1, 0, 1, 0, 1, 0, 1, 1]], max_rounds=1, prompts=4, dp=4)
    with caplog.at_level("WARNING", logger="hybridflow"):
        batch, metrics = t._sample_groups(prepare())
    assert batch["prompt"].tolist() == [10, 10, 11, 11]  # 3 varied groups kept, the last one dropped
    assert metrics["data/train_groups"] == 2.0 and len(batch) % 4 == 0
    assert any("kept 3 of the 4 groups" in r.getMessage() and "1 more dropped so that the 4 rows split evenly over 4 data-parallel ranks"
               in r.getMessage() for r in caplog.records)
    t, prepare = _dynamic_trainer([[1, 0, 1, 1, 1, 1, 0, 0]], max_rounds=1, prompts=4, dp=4)  # one varied group: none can train
    batch, metrics = t._sample_groups(prepare())
    assert len(batch) == 0 and metrics["data/train_groups"] == 0.0 and metrics["data/underfilled_batches"] == 1.0


def test_a_step_whose_dynamic_sampling_kept_no_trainable_group_skips_its_update():
    from hybridflow.trainer.dataflow import DataFlow, Stage

    t, prepare = _dynamic_trainer([[1, 1, 0, 0]], max_rounds=1)
    t.roles = type("Roles", (), {"async_rollout": False, "use_rm": False})()
    t._next_batch = None

    def update(b):
        raise AssertionError("no update without a group to train on")

    metrics = t.train_step(DataFlow([Stage("update_actor", update, ["prompt"], [])]))
    assert metrics["train/skipped_updates"] == 1.0 and metrics["data/underfilled_batches"] == 1.0 and "timing_s/step" in metrics




def test_mismatch_alarm_fires_on_a_jump_and_keeps_its_history():
    """rollout/logprob_diff_alarm: a step over factor x the median of the previous ones fires (with at
    least 3 before it); a zero history (exact mode) makes any non-zero value a jump; off at 0."""
    from hybridflow.trainer.metrics import MismatchAlarm

    alarm = MismatchAlarm(10.0)
    fired = []
    for step, v in enumerate([3e-6, 4e-5, 2e-6, 3e-6, 3e-5, 5e-5], start=1):
        m = {"rollout/logprob_diff_max": v}
        text = alarm.check(step, m)
        assert m["rollout/logprob_diff_alarm"] == float(text is not None)
        if text:
            fired.append(step)
            assert f"step {step}:" in text and "trainer.mismatch_alarm_factor" in text
    # step 2's jump has fewer than 3 steps before it; step 5 (3e-5) is 10 x the median 3e-6, not over it;
    # step 6 (5e-5) is over 10 x median(3e-6, 4e-5, 2e-6, 3e-6, 3e-5) = 3e-5
    assert fired == [6]
    resumed = MismatchAlarm(10.0, history=[0.0] * 5)  # restored from a checkpoint of an exact run
    assert resumed.check(6, {"rollout/logprob_diff_max": 1e-9}) is not None
    assert MismatchAlarm(0.0).check(1, {"rollout/logprob_diff_max": 1.0}) is None
    assert alarm.check(8, {}) is None  # a step without the metric (no recomputed log-probs)
