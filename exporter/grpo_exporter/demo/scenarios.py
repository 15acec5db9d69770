"""The fault scenarios: what each injects, and which alert (and layer) it should page with.

Status: the injections are implemented and their signals are verified at the metric level
(tests/test_demo.py); the end-to-end paging of every scenario through Prometheus and Alertmanager is the
next step of issue 6.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_exporter.demo.trainer import Trainer


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    expected_alerts: tuple[str, ...]
    layer: str
    inject: Callable[[Trainer], None]


def _set(**changes: object) -> Callable[[Trainer], None]:
    def inject(trainer: Trainer) -> None:
        for name, value in changes.items():
            setattr(trainer.faults, name, value)

    return inject


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("healthy", "no fault", (), "", _set()),
        Scenario("engine-desync", "the weight sync silently skips the tied embedding",
                 ("GRPOEngineLogprobGapWarning",), "1-gradient", _set(engine_skip=("embed.weight",))),
        Scenario("engine-precision", "the rollout engine computes in bf16",
                 ("GRPOEngineLogprobGapCritical",), "1-gradient", _set(engine_precision=torch.bfloat16)),
        Scenario("mask-bug", "the loss mask covers the padding after EOS",
                 ("GRPOLossMaskMismatch",), "1-gradient", _set(mask_covers_padding=True)),
        Scenario("exp-before-clamp", "a -inf sentinel reaches a loss token and the ratio is exp'd before clamp",
                 ("GRPONonFiniteValues",), "1-gradient", _set(exp_before_clamp=True)),
        Scenario("grad-accum-scaling", "the loss is not divided by the accumulation steps",
                 ("GRPOGradClippingEveryStep",), "1-gradient", _set(loss_not_divided_by_accumulation=True)),
        Scenario("advantage-bug", "advantages use the std of half-groups: |A| above (G-1)/sqrt(G)",
                 ("GRPOAdvantageAboveBound",), "2-reward", _set(advantage_wrong_groups=True)),
        Scenario("reward-hack", "a length-paying format component dominates a down-weighted correctness",
                 ("GRPORewardHackSuspected",), "2-reward", _set(reward_hack=True)),
        Scenario("entropy-collapse", "an entropy penalty drives the policy to a few completions",
                 ("GRPOEntropyCollapse",), "4-diversity", _set(entropy_penalty=1.0)),
        Scenario("stale-rollouts", "one rollout batch is reused for every later update",
                 ("GRPORolloutsStale",), "3-samples", _set(reuse_rollouts=True)),
        Scenario("truncation", "the maximum completion length shrinks below the answer length",
                 ("GRPOTruncationSurge",), "2-reward", _set(max_new=3)),
        Scenario("verifier-broken", "the verifier scores every answer 0",
                 ("GRPORewardCliff",), "2-reward", _set(verifier_broken=True)),
    )
}
