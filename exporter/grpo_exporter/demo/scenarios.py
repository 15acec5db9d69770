"""The fault scenarios: what each injects, when, and which alert (and layer) it should page with.

The rollout engine computes in bf16, as real engines do: its healthy gap (~0.015 nats on the permutation task)
is noise above the seed's 0.01 line, which the run's notice GRPOEngineLogprobGapCleanLevelHigh (info, once) says.
The demo trains at :data:`STEPS_PER_SECOND` against rules with time shrunk 50x (``demo_mixin``). A fault whose
alert compares against the run's own history (a rolling baseline: 20 samples in a window that ends 12 s back)
is injected only after :data:`HISTORY_STEPS` healthy steps; the others after :data:`EARLY_STEPS`.
Every scenario is checked end to end through a real Prometheus and Alertmanager by ``tests/test_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_exporter.demo.trainer import DemoConfig, Trainer

STEPS_PER_SECOND = 2.0
EARLY_STEPS = 16  # 8 s: the exporter is scraped and the run's first samples are in
HISTORY_STEPS = 80  # 40 s: rolling baselines exist (20 samples, window ending 12 s back) with room to spare
# entropy-collapse: loss + 1.25 x mean token entropy. At 1.0 the fall of pass@G was marginal (seed 1: 0.99 -> 0.81
# for ten steps, then back to 0.93 while pass@1 rose): whether it paged depended on the CPU's float rounding, and
# a CI machine missed it. At 1.25 pass@G falls 0.99 -> 0.5-0.6 within 50 steps on seeds 1, 2 and 4 while pass@1
# holds near its level (0.38 -> 0.25-0.30), the seed's signature (pass@k falls, pass@1 holds).
ENTROPY_PENALTY = 1.25
TOOL_AT = 2  # the multi-turn scenarios: the tool is called after the model's second answer token
# pool-shrinks: the prompts the stuck sampler serves. Seed 3 (warm start at 0.33) masters 4 of them within ~60
# steps: the kept share of generated groups falls from ~0.8 to the cap's 0.25 (4 rounds); 8 took ~90 steps
POOL_STUCK = 4
# the MoE scenarios' policy: 8 experts per layer, top-2 (a bf16 engine routes ~0.3% of decisions differently from
# the fp32 trainer, steady; a sync that skips the routers takes it to 2-9% within ~40 steps on seed 0)
MOE_EXPERTS = 8


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    expected_alerts: tuple[str, ...]
    layer: str
    inject: Callable[[Trainer], None]
    needs_history: bool = False
    inject_step: int | None = None  # overrides the default step (0: a fault present from the first step)
    seed: int = 3
    task: str = "permute"  # grpo_exporter.demo.task.TASKS: "reverse" has one right answer, which the policy learns
    tool_at: int = 0  # > 0: multi-turn, a tool's reply written into each completion after this many tokens
    dynamic_sampling: bool = False  # DAPO's loop: only groups with both outcomes fill the batch
    experts: int = 0  # > 0: a mixture-of-experts policy (DemoConfig.experts)
    routing_replay: bool = False  # the trainer replays the engine's routing (R3)

    # seed: the default of the demo and the one the end-to-end suite runs. entropy-collapse and reward-hack take
    # seeds whose policy is still weak at injection. From a policy that already solves most prompts, the
    # collapse lands on correct answers (pass@G holds: by design GRPOEntropyCollapse stays silent, convergence
    # is no page), and the hack costs correctness only on the ~51% of prompts without the paid symbol (seed 3:
    # the 12-step mean falls below 0.7x baseline after 50 steps, against 20 from seed 0).

    def config(self, seed: int | None = None) -> DemoConfig:
        """The demo's training config for this scenario's task (and ``seed``, default the scenario's).

        torch is imported here, not with the module: the CLI reads the scenarios' names to build its parser."""
        from grpo_exporter.demo.task import TOOL_LENGTH, Task
        from grpo_exporter.demo.trainer import DemoConfig

        default = DemoConfig()
        return DemoConfig(seed=self.seed if seed is None else seed,
                          max_new=default.max_new + (TOOL_LENGTH if self.tool_at else 0),
                          dynamic_sampling=self.dynamic_sampling, experts=self.experts,
                          routing_replay=self.routing_replay,
                          task=Task(symbols=default.task.symbols, length=default.task.length, kind=self.task,
                                    tool_at=self.tool_at))

    @property
    def inject_at(self) -> int:
        """The default step of injection."""
        if self.inject_step is not None:
            return self.inject_step
        return HISTORY_STEPS if self.needs_history else EARLY_STEPS


def _set(**changes: object) -> Callable[[Trainer], None]:
    def inject(trainer: Trainer) -> None:
        for name, value in changes.items():
            setattr(trainer.faults, name, value)

    return inject


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("healthy", "no fault", (), "", _set(), seed=0),
        Scenario("healthy-reverse", "no fault, on a task with one right answer (reverse the symbols) that the "
                 "policy learns: groups converge to identical correct completions, mostly all-correct", (), "",
                 _set(), seed=0, task="reverse"),
        Scenario("healthy-tool", "no fault, on a multi-turn task: after two answer tokens the model calls a tool "
                 "and the environment writes its 2-token reply into the completion, off the loss mask", (), "",
                 _set(), seed=0, tool_at=TOOL_AT),
        Scenario("loss-on-tool-tokens", "multi-turn: the loss mask keeps the tool's reply (the model is trained on "
                 "text it never sampled, verl #4412)", ("GRPOLossOnToolTokens",), "1-gradient",
                 _set(loss_on_tool_tokens=True), seed=0, tool_at=TOOL_AT),
        Scenario("length-counts-tool-tokens", "multi-turn: the completion lengths handed on count the tool's reply "
                 "(a span, not the model's tokens: OpenRLHF #1252)", ("GRPOCompletionLengthCountsToolTokens",),
                 "2-reward", _set(length_counts_tool_tokens=True), seed=0, tool_at=TOOL_AT),
        Scenario("healthy-moe", "no fault, with a mixture-of-experts policy (8 experts a layer, top-2) and no "
                 "routing replay: the bf16 engine routes some near-ties differently from the trainer, a steady "
                 "level", (), "", _set(), seed=0, experts=MOE_EXPERTS),
        Scenario("moe-router-stale", "MoE, no routing replay: part-way through, the weight sync skips the routers "
                 "(their gate weights stay stale while the trainer's move, SkyRL #1680)",
                 ("GRPORoutingMismatchRising",), "1-gradient", _set(router_sync_skipped=True), needs_history=True,
                 seed=0, experts=MOE_EXPERTS),
        Scenario("moe-replay-drops-layer", "MoE with routing replay (R3): part-way through, the replay leaves out "
                 "the second MoE layer, which the trainer then routes itself", ("GRPORoutingReplayFellBack",),
                 "1-gradient", _set(replay_skipped_layer=1), seed=0, experts=MOE_EXPERTS, routing_replay=True),
        Scenario("pool-shrinks", "a dynamic-sampling (DAPO) loop whose sampler gets stuck on 4 prompts (a data "
                 "loader on one small shard): the policy masters them, and filling the batch with groups of both "
                 "outcomes takes ever more generation while the batch looks full",
                 ("GRPODynamicSamplingPoolShrinking",), "3-samples", _set(prompt_pool=POOL_STUCK),
                 needs_history=True, dynamic_sampling=True),
        Scenario("engine-top-p", "from the first step the engine samples from the top-p 0.8 nucleus and reports "
                 "log-probs renormalised over it (higher on every token: the signed gap equals the mean gap)",
                 ("GRPOEngineLogprobGapCritical",), "1-gradient", _set(engine_top_p=0.8), inject_step=0),
        Scenario("engine-temperature", "from the first step the engine samples and reports log-probs at "
                 "temperature 0.7, which the trainer does not apply", ("GRPOEngineLogprobGapCritical",),
                 "1-gradient", _set(engine_temperature=0.7), inject_step=0),
        Scenario("engine-stale-weights", "part-way through a healthy bf16 run the weight sync stops copying (the "
                 "engine keeps stale weights, as after a failed wake from sleep mode) while reporting success",
                 ("GRPOEngineLogprobGapCritical",), "1-gradient", _set(engine_frozen=True), needs_history=True),
        Scenario("mask-bug", "the loss mask covers the padding after EOS",
                 ("GRPOLossMaskMismatch",), "1-gradient", _set(mask_covers_padding=True)),
        Scenario("exp-before-clamp", "a -inf sentinel reaches a loss token and the ratio is exp'd before clamp",
                 ("GRPONonFiniteValues",), "1-gradient", _set(exp_before_clamp=True)),
        Scenario("grad-accum-scaling", "the loss is not divided by the accumulation steps",
                 ("GRPOGradClippingEveryStep",), "1-optimizer", _set(loss_not_divided_by_accumulation=True)),
        Scenario("advantage-bug", "advantages use the std of half-groups: |A| above (G-1)/sqrt(G)",
                 ("GRPOAdvantageAboveBound",), "2-reward", _set(advantage_wrong_groups=True)),
        Scenario("reward-hack", "a format component paying for a quirk (answers opening with the first symbol) "
                 "outweighs correctness", ("GRPORewardHackSuspected",), "2-reward", _set(reward_hack=True),
                 needs_history=True, seed=0),
        Scenario("entropy-collapse", "an entropy penalty (a bonus with the wrong sign) sharpens the policy onto a "
                 "few completions", ("GRPOEntropyCollapse",), "4-diversity", _set(entropy_penalty=ENTROPY_PENALTY),
                 needs_history=True, seed=1),
        Scenario("stale-rollouts", "one rollout batch is reused for every later update",
                 ("GRPORolloutsStale",), "3-samples", _set(reuse_rollouts=True)),
        Scenario("truncation", "the maximum completion length shrinks below the answer length",
                 ("GRPOTruncationSurge",), "2-reward", _set(max_new=3), needs_history=True),
        Scenario("verifier-broken", "the verifier scores every answer 0",
                 ("GRPORewardCliff",), "2-reward", _set(verifier_broken=True), needs_history=True),
    )
}
