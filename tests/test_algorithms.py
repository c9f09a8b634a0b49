"""RL algorithm variants against their papers' formulas on hand-computed cases: loss types and reductions (values
and gradients), advantage estimators, the difficulty filter, learning-rate schedules, and their config errors."""

import math

import pytest
import torch

from primerl.app import check
from primerl.config.orchestrator import FilterConfig
from primerl.config.trainer import LossConfig, LrScheduleConfig, OffPolicyConfig
from primerl.orchestrator.advantages import group_advantages
from primerl.trainer.logprobs import TokenScores
from primerl.trainer.loss import BatchTotals, policy_loss, with_sequence_tokens
from primerl.trainer.lr_schedule import scheduled_lr
from primerl.utils.errors import ConfigError

# One packed row: sequence 0 at positions 0-3 (tokens 2, 3 sampled), sequence 1 at 4-8 (tokens 6, 7, 8 sampled).
# The loss scores token t from column t-1: logprobs[t-1] is log pi_theta(token t).
POSITIONS = [0, 1, 2, 3, 0, 1, 2, 3, 4]
SAMPLED = [False, False, True, True, False, False, True, True, True]
LOGP = [-1.0, -0.5, -2.0, -0.7, -1.1, -0.3, -0.9, -1.6, 0.0]  # column t-1 scores token t; the last is a dummy
INFERENCE = [0.0, 0.0, -1.8, -0.6, 0.0, 0.0, -0.5, -1.9, -0.2]  # per token t
ADVANTAGE = [0.0, 0.0, 0.6, 0.6, 0.0, 0.0, -0.4, -0.4, -0.4]
TOKENS = [t for t in range(9) if SAMPLED[t]]
SEQUENCE = {2: 0, 3: 0, 6: 1, 7: 1, 8: 1}
CLIP = (0.8, 1.28)


def ratio(t: int) -> float:
    return math.exp(LOGP[t - 1] - INFERENCE[t])


def loss_and_grad(cfg: LossConfig, totals: BatchTotals, reference: list[float] | None = None):
    """(loss, d loss / d logprobs, the loss parts) of the case above."""
    logprobs = torch.tensor([LOGP], dtype=torch.float64, requires_grad=True)
    micro = {
        "position_ids": torch.tensor([POSITIONS]),
        "loss_mask": torch.tensor([SAMPLED]),
        "inference_logprobs": torch.tensor([INFERENCE], dtype=torch.float64),
        "advantages": torch.tensor([ADVANTAGE], dtype=torch.float64),
    }
    scores = TokenScores(logprobs, torch.zeros(1, 9), None if reference is None else torch.tensor([reference]))
    parts = policy_loss(scores, with_sequence_tokens(micro), totals, cfg)
    parts.loss.backward()
    return parts.loss.item(), logprobs.grad[0].tolist(), parts


def weight(reduction: str, t: int) -> float:
    """w_t: token 1/N, sequence 1/(S |y_i|), constant 1/(S L) with N=5, S=2, |y|=(2, 3), L=10."""
    return {"token": 1 / 5, "sequence": 1 / (2 * (2, 3)[SEQUENCE[t]]), "constant": 1 / (2 * 10)}[reduction]


def expected(kind: str, reduction: str) -> tuple[float, dict[int, float]]:
    """The papers' objectives, written per token: (loss, d loss / d log pi_theta(token t))."""
    low, high = CLIP
    loss, grad = 0.0, {}
    for t in TOKENS:
        a, w = ADVANTAGE[t], weight(reduction, t)
        if kind == "is_pg":
            term, dterm = -ratio(t) * a, -ratio(t) * a
        elif kind == "ppo_clip":
            clipped = min(max(ratio(t), low), high)
            use_clipped = clipped * a < ratio(t) * a
            term = -min(ratio(t) * a, clipped * a)
            dterm = 0.0 if use_clipped else -ratio(t) * a
        elif kind == "cispo":
            weight_is = min(max(ratio(t), low), high)
            term, dterm = -weight_is * a * LOGP[t - 1], -weight_is * a
        else:  # gspo: s_i = exp(mean of the sequence's log-ratios)
            members = [u for u in TOKENS if SEQUENCE[u] == SEQUENCE[t]]
            s = math.exp(sum(LOGP[u - 1] - INFERENCE[u] for u in members) / len(members))
            clipped = min(max(s, low), high)
            term = -min(s * a, clipped * a)
            dterm = 0.0 if clipped * a < s * a else -s * a
        loss += w * term
        grad[t - 1] = w * dterm
    return loss, grad


@pytest.mark.parametrize("kind", ["is_pg", "ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("reduction", ["token", "sequence", "constant"])
def test_loss_types_and_reductions_match_the_formulas(kind, reduction):
    cfg = LossConfig(type=kind, reduction=reduction, clip_ratio_low=CLIP[0], clip_ratio_high=CLIP[1])
    loss, grad, _ = loss_and_grad(cfg, BatchTotals(tokens=5, sequences=2, constant_tokens=10))
    want_loss, want_grad = expected(kind, reduction)
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=1e-12)  # the weights are fp32
    assert grad == pytest.approx([want_grad.get(i, 0.0) for i in range(9)], rel=1e-6, abs=1e-12)


def test_the_case_exercises_both_sides_of_each_clip():
    """Without this the clipped branches above could go untested: ratios fall below, inside and above [0.8, 1.28]."""
    ratios = [ratio(t) for t in TOKENS]
    assert min(ratios) < CLIP[0] and max(ratios) > CLIP[1] and any(CLIP[0] <= r <= CLIP[1] for r in ratios)
    _, ppo_grad, _ = loss_and_grad(LossConfig(type="ppo_clip"), BatchTotals(5, 2))
    _, pg_grad, _ = loss_and_grad(LossConfig(), BatchTotals(5, 2))
    assert sum(g == 0.0 for g in ppo_grad) > sum(g == 0.0 for g in pg_grad)  # some token lost its gradient to the clip


def is_weight(level: str, t: int) -> float:
    """w_t: the token's ratio, its sequence's product of ratios, or their geometric mean."""
    if level == "token":
        return ratio(t)
    members = [u for u in TOKENS if SEQUENCE[u] == SEQUENCE[t]]
    log_sum = sum(math.log(ratio(u)) for u in members)
    return math.exp(log_sum if level == "sequence" else log_sum / len(members))


@pytest.mark.parametrize("kind", ["is_pg", "ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize(
    "correction,level,low,high",
    [
        ("tis", "token", 0.5, 2.0),  # truncates tokens 2 and 7 (ratios 3.7 and 2.7)
        ("tis", "sequence", 0.5, 0.85),  # truncates sequence 0 (product 0.905)
        ("mask", "token", 0.5, 2.0),  # IcePop: keeps token 6 alone
        ("mask", "geometric", 0.94, 2.0),  # drops sequence 1 (geometric mean 0.936)
        ("mask", "sequence", 0.85, 2.0),  # drops sequence 1 (product 0.819)
    ],
)
def test_off_policy_corrections_match_the_formulas(kind, correction, level, low, high):
    """With a correction each loss type is taken against the trainer's own policy at this pass (ratio 1, gradient
    grad log pi_theta) and weighted by c_t: min(w_t, high) (TIS), or w_t where low <= w_t <= high and 0 elsewhere
    (masked IS; IcePop at token level). Logged: sum and max of w_t over sampled tokens, tokens truncated or masked."""
    off = OffPolicyConfig(correction=correction, level=level, low=low, high=high)
    cfg = LossConfig(type=kind, off_policy=off)
    loss, grad, parts = loss_and_grad(cfg, BatchTotals(5, 2))
    want_loss, want_grad, affected = 0.0, [0.0] * 9, 0
    for t in TOKENS:
        w = is_weight(level, t)
        c, kept = (min(w, high), True) if correction == "tis" else (w, low <= w <= high)
        affected += (w > high) if correction == "tis" else not kept
        a = ADVANTAGE[t]
        want_loss += kept * c * -a * (LOGP[t - 1] if kind == "cispo" else 1.0) / 5
        want_grad[t - 1] = kept * c * -a / 5
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-6, abs=1e-12)
    weights = [is_weight(level, t) for t in TOKENS]
    sums = parts.sums()
    assert sums["is_weight"] == pytest.approx(sum(weights)) and sums["is_weight_max"] == pytest.approx(max(weights))
    assert sums["corrected"] == affected and 0 < affected < len(TOKENS)


def test_the_reference_kl_is_k3_added_with_its_coefficient_and_logged_at_zero():
    """q_t = log pi_ref - log pi_theta; the term kl_coef * (exp(q) - q - 1) per token, weighted like the loss; its
    gradient in log pi_theta is kl_coef * (1 - exp(q)) per token."""
    reference = [lp + 0.3 * (i % 3 - 1) for i, lp in enumerate(LOGP)]
    base_loss, base_grad, _ = loss_and_grad(LossConfig(), BatchTotals(5, 2))
    loss, grad, parts = loss_and_grad(LossConfig(kl_coef=0.5), BatchTotals(5, 2), reference)
    q = {t: reference[t - 1] - LOGP[t - 1] for t in TOKENS}
    k3 = {t: math.exp(q[t]) - q[t] - 1 for t in TOKENS}
    assert parts.reference_kl_sum == pytest.approx(sum(k3.values()))
    assert loss == pytest.approx(base_loss + 0.5 * sum(k3.values()) / 5, rel=1e-6)
    want = [base_grad[i] + (0.5 * (1 - math.exp(q[i + 1])) / 5 if i + 1 in TOKENS else 0.0) for i in range(9)]
    assert grad == pytest.approx(want, rel=1e-6)
    _, _, logged = loss_and_grad(LossConfig(kl_coef=0.0, log_reference_kl=True), BatchTotals(5, 2), reference)
    assert (
        logged.sums()["reference_kl"] == pytest.approx(sum(k3.values())) and parts.sums().keys() == logged.sums().keys()
    )


def custom_reinforce(logprobs, inference_logprobs, advantages, mask):
    """A user's loss for the custom entry: plain REINFORCE."""
    return -advantages * logprobs


def test_a_custom_loss_is_imported_by_path_and_reduced_like_the_others():
    cfg = LossConfig(type="custom", custom="tests.test_algorithms:custom_reinforce")
    loss, grad, _ = loss_and_grad(cfg, BatchTotals(5, 2))
    assert loss == pytest.approx(sum(-ADVANTAGE[t] * LOGP[t - 1] / 5 for t in TOKENS))
    assert grad == pytest.approx([-ADVANTAGE[i + 1] / 5 if i + 1 in TOKENS else 0.0 for i in range(9)])


def test_advantage_estimators():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = 0.6
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 5)
    assert group_advantages(rewards, "mean") == pytest.approx([r - mean for r in rewards])
    assert group_advantages(rewards, "grpo") == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])
    loo = [r - (sum(rewards) - r) / 4 for r in rewards]
    assert group_advantages(rewards, "rloo") == pytest.approx(loo)
    for kind in ("mean", "grpo", "rloo"):
        assert group_advantages([0.5, 0.5, 0.5], kind) == [0.0, 0.0, 0.0]
    assert group_advantages([0.3], "rloo") == [0.0]


def test_the_filter_keeps_groups_with_signal_inside_the_band():
    assert FilterConfig().keeps([1.0, 1.0])  # off by default
    zero_variance = FilterConfig(zero_variance=True)
    assert not zero_variance.keeps([1.0, 1.0]) and not zero_variance.keeps([0.0, 0.0])
    assert zero_variance.keeps([0.0, 1.0])
    band = FilterConfig(min_pass_rate=0.25, max_pass_rate=0.75)
    assert [band.keeps(r) for r in ([0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0])] == [
        True,
        True,
        True,
        False,
    ]
    assert not FilterConfig(max_pass_rate=0.5).keeps([1, 1, 0])


def test_lr_schedules():
    constant, warmup = LrScheduleConfig(), LrScheduleConfig(type="warmup", warmup_steps=4)
    cosine = LrScheduleConfig(type="cosine", warmup_steps=2, min_ratio=0.1)
    assert [scheduled_lr(constant, s, 1.0, 10) for s in (0, 9)] == [1.0, 1.0]
    assert [scheduled_lr(warmup, s, 1.0, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lrs = [scheduled_lr(cosine, s, 1.0, 10) for s in range(11)]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[10] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["trainer.loss.type=ppo"], "trainer.loss.type"),
        (["trainer.loss.reduction=mean"], "trainer.loss.reduction"),
        (["trainer.loss.off_policy.correction=clip"], "trainer.loss.off_policy.correction"),
        (["trainer.loss.off_policy.correction=mask", "trainer.loss.off_policy.low=1.5"], "trainer.loss.off_policy.low"),
        (["orchestrator.advantage=gae"], "orchestrator.advantage"),
        (["trainer.lr_schedule.type=linear"], "trainer.lr_schedule.type"),
        (["trainer.loss.clip_ratio_low=1.05"], "trainer.loss.clip_ratio_low"),
        (["trainer.loss.clip_ratio_high=0.95"], "trainer.loss.clip_ratio_low"),
        (["trainer.loss.type=custom"], "trainer.loss.custom"),
        (["trainer.loss.type=custom", "trainer.loss.custom=no_such_module:f"], "trainer.loss.custom"),
        (["trainer.loss.type=custom", "trainer.loss.custom=math:pi"], "trainer.loss.custom"),
        (["trainer.loss.type=custom", "trainer.loss.custom=math:sqrt"], "trainer.loss.custom"),
        (["trainer.loss.custom=tests.test_algorithms:custom_reinforce"], "trainer.loss.custom"),
        (["trainer.loss.type=gspo", "parallelism=fsdp2_cp"], "trainer.loss.type"),
        (["orchestrator.filter.min_pass_rate=0.8", "orchestrator.filter.max_pass_rate=0.2"], "min_pass_rate"),
        (["orchestrator.filter.zero_variance=true", "orchestrator.group_size=1", "orchestrator.batch_size=4"], "zero"),
        (
            [
                "orchestrator.filter.zero_variance=true",
                "orchestrator.filter.min_pass_rate=1.0",
                "orchestrator.filter.max_pass_rate=1.0",
            ],
            "orchestrator.filter.max_pass_rate",
        ),
    ],
)
def test_bad_algorithm_settings_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key) as err:
        check(["+experiment=reverse_text", *overrides])
    assert "\n" not in str(err.value)


def test_the_algorithm_settings_compose():
    cfg = check(
        [
            "+experiment=reverse_text",
            "trainer.loss.type=custom",
            "trainer.loss.custom=tests.test_algorithms:custom_reinforce",
            "trainer.loss.reduction=constant",
            "orchestrator.advantage=rloo",
            "orchestrator.filter.zero_variance=true",
            "trainer.lr_schedule.type=cosine",
        ]
    )
    assert (cfg.trainer.loss.type, cfg.orchestrator.advantage, cfg.orchestrator.filter.zero_variance) == (
        "custom",
        "rloo",
        True,
    )
