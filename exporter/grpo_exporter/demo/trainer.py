"""A real GRPO loop on the CPU: brief supervised warm start, then rollouts from a separate engine, group
sigma-normalised advantages, the PPO-clip loss (log ratio clamped before exp), gradient accumulation, and an
optimizer step per epoch over the rollout, with every fault of :mod:`grpo_exporter.demo.scenarios` injectable at
a chosen step. The loop's own choices (epochs, micro-batches, loss aggregation, optimizer, warm-up, grad clip,
KL in the loss: :mod:`grpo_exporter.demo.loop`) are settings, as the world sweep varies them.

It talks to grpo-exporter only through the public ``GRPOMonitor`` API, like any user's loop.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo_exporter import GRPOMonitor
from grpo_exporter.demo import dynamic_sampling, loop, routing
from grpo_exporter.demo.engine import Rollout, RolloutEngine
from grpo_exporter.demo.model import TinyLM
from grpo_exporter.demo.rewards import rewards as rewards_of
from grpo_exporter.demo.task import PAD, TOOL_LENGTH, Task


@dataclass
class Faults:
    """Switches for the injected bugs; all off is a healthy run."""

    engine_frozen: bool = False
    engine_top_p: float = 1.0
    engine_temperature: float = 1.0
    mask_covers_padding: bool = False
    exp_before_clamp: bool = False
    loss_not_divided_by_accumulation: bool = False
    advantage_wrong_groups: bool = False
    reward_hack: bool = False
    entropy_penalty: float = 0.0
    reuse_rollouts: bool = False
    max_new: int | None = None
    verifier_broken: bool = False
    old_logprob_temperature: float = 1.0  # != 1: a second probability path, the old log-probs' pass scales logits
    # multi-turn tasks (Task.tool_at): the loss mask keeps the tool's reply (verl #4412, slime #1370); the length
    # handed on is the completion's span, the tool's tokens counted (OpenRLHF #1252)
    loss_on_tool_tokens: bool = False
    length_counts_tool_tokens: bool = False
    # > 0: the sampler draws every prompt from this many fixed ones (a data loader stuck on one small shard):
    # the policy masters them, and a dynamic-sampling loop generates ever more to fill its batch
    prompt_pool: int = 0
    # the optimizer's faults that make a true grad-norm spike: a learning rate multiplied (a schedule or a
    # resumed optimizer state gone wrong), and the loss multiplied by the accumulation steps where it should be
    # divided (the gradient micro_batches^2 times its size)
    lr_multiplier: float = 1.0
    loss_times_accumulation: bool = False
    # an MoE policy's: the engine's weight sync skips the routers (their gate weights go stale, SkyRL #1680's
    # corrupted MoE rollouts after the first sync); with routing replay on, the replay leaves out this layer (the
    # trainer routes it itself: a layer the replay does not cover)
    router_sync_skipped: bool = False
    replay_skipped_layer: int | None = None


@dataclass
class DemoConfig:
    seed: int = 0
    prompts_per_step: int = 8
    group_size: int = 8
    max_new: int = 9
    warmup_steps: int = 400
    warmup_lr: float = 3e-3
    warmup_target: float = 0.3
    lr: float = 2e-4
    micro_batches: int = 4
    # None: no clipping (the norm is still measured); healthy pre-clip norms stay near 0.5-1.2, an unscaled
    # 4-step accumulation is ~4x
    max_grad_norm: float | None = 1.5
    epochs: int = 1  # optimizer steps per rollout batch, each over all its micro-batches (PPO epochs)
    loss_aggregation: str = "token"  # loop.AGGREGATIONS
    optimizer: str = "adam"  # loop.OPTIMIZERS
    lr_warmup_steps: int = 0  # linear learning-rate warm-up over this many optimizer steps
    kl_coef: float = 0.0  # > 0: beta times the k3 KL to the warm-started reference in the loss
    clip_eps: tuple[float, float] = (0.2, 0.28)
    log_ratio_clamp: float = 20.0
    format_weight: float = 0.1
    partial_weight: float = 0.0  # > 0: a "partial" reward component, Task.partial times this (several components)
    engine_precision: torch.dtype = torch.bfloat16  # as real engines run; float32 matches the trainer to ~1e-7
    # the trainer's forward: float32, or bfloat16 as a mixed-precision FSDP/Megatron trainer (CPU autocast: fp32
    # master weights, bf16 matmuls), whose results depend on the batch layout (batch-variant kernels)
    trainer_precision: torch.dtype = torch.float32
    # rows per forward when the old log-probs are recomputed (None: the whole batch in one pass); the updates
    # always run in ``micro_batches`` chunks. 1 recomputes each sequence alone, another layout than the update's
    old_logprob_rows: int | None = None
    task: Task = field(default_factory=lambda: Task(symbols=8, length=5))
    # DAPO's dynamic sampling (seed 第 4 篇 4.1-4.3): generation rounds of prompts_per_step prompts until as many
    # groups with both outcomes are kept (at most dynamic_sampling_rounds; the batch is then topped up with
    # filtered groups), the filter's counts handed to the monitor
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = 4
    # > 0: a mixture-of-experts policy, each layer's feed-forward block this many experts, top_k per token; with
    # routing_replay the trainer's forwards replay the engine's routing (R3)
    experts: int = 0
    top_k: int = 2
    routing_replay: bool = False

    def monitor_settings(self) -> dict[str, Any]:
        """The GRPOMonitor settings this loop implies (its group size, clip, fuse and experts per MoE layer); the
        reading set keeps its text (the demo's prompts are synthetic: nothing private)."""
        return {"group_size": self.group_size, "clip_eps": self.clip_eps, "log_ratio_clamp": self.log_ratio_clamp,
                "moe_experts": self.experts or None, "reading_text": True}


@dataclass
class StepReport:
    step: int
    reward: float
    correct: float  # pass@1 of the step's rollouts
    truncated: float
    grad_norm: float
    skipped: bool
    pass_at_group: float = 0.0  # share of groups with a correct completion (the trainer's own pass@G)
    peak_grad_norm: float = 0.0  # the largest finite pre-clip norm of the step's optimizer steps (epochs)


class Trainer:
    def __init__(self, config: DemoConfig, monitor: GRPOMonitor) -> None:
        self.config, self.monitor = config, monitor
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.task = config.task
        self.policy = TinyLM(self.task.vocab, context=self.task.prompt_length + config.max_new, experts=config.experts,
                             top_k=config.top_k)
        self.optimizer = loop.Optimizer(self.policy.parameters(), config.optimizer, config.lr, config.lr_warmup_steps)
        self.reference: TinyLM | None = None  # the KL term's frozen policy (kl_coef > 0), set after the warm start
        self.engine = RolloutEngine(self.policy, config.engine_precision)
        self.version = 0
        self.faults = Faults()
        self._reused: Rollout | None = None
        self._reused_old: tuple[Tensor, Tensor | None] | None = None
        self._pool: tuple[Tensor, Tensor] | None = None  # the prompt_pool fault's fixed prompts
        self._filter: dict[str, int] = {}  # the last dynamic-sampling batch's counts (dynamic_sampling.fill)

    # ---- the brief supervised warm start: mixed groups from the first RL step ----
    def warm_start(self) -> float:
        """Supervised steps until sampled accuracy reaches ``warmup_target`` (checked every 10 steps) or for
        ``warmup_steps``, so that the first RL groups are mixed rather than all wrong; returns the accuracy
        last measured (seed 0 ends at the cap with 0.14, seeds 1-3 at 0.31-0.39)."""
        c = self.config
        opt = torch.optim.AdamW(self.policy.parameters(), lr=c.warmup_lr)
        accuracy = 0.0
        for i in range(c.warmup_steps):
            prompts, _ = self.task.prompts(64, self.generator)
            answers = self.task.with_tool(prompts, self.task.answers(prompts, self.generator))
            sequence = torch.cat([prompts, answers], dim=1)
            logits = self.policy(sequence[:, :-1])[:, self.task.prompt_length - 1 :]
            targets = sequence[:, self.task.prompt_length :].masked_fill(sequence[:, self.task.prompt_length :] == PAD,
                                                                           -100)  # nothing to learn after EOS
            if self.task.tool_at:  # nor from the tool's reply: the environment writes it
                targets[:, self.task.tool_at : self.task.tool_at + TOOL_LENGTH] = -100
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i % 10 == 9:
                accuracy = self.sampled_accuracy()
                if accuracy >= c.warmup_target:
                    break
        self.engine.sync(self.policy, self.version)
        self._freeze_reference()
        return accuracy

    def _freeze_reference(self) -> None:
        """The KL term's reference: the warm-started policy, frozen (only with ``kl_coef`` > 0)."""
        if self.config.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).requires_grad_(False)

    def snapshot(self) -> dict[str, object]:
        """The warm-started state (weights, sampling generator, policy version): a warm start is deterministic
        per seed, so runs of one seed can share it instead of repeating it."""
        return {"policy": copy.deepcopy(self.policy.state_dict()), "generator": self.generator.get_state(),
                "version": self.version}

    def restore(self, snapshot: dict[str, object]) -> None:
        """Continue from :meth:`snapshot` (the engine is synchronised, the RL optimizer starts fresh)."""
        self.policy.load_state_dict(snapshot["policy"])  # type: ignore[arg-type]
        self.generator.set_state(snapshot["generator"])  # type: ignore[arg-type]
        self.version = int(snapshot["version"])  # type: ignore[call-overload]
        self.engine.sync(self.policy, self.version)
        self._freeze_reference()

    @torch.no_grad()
    def sampled_accuracy(self, prompts: int = 32) -> float:
        """Share of correct samples (temperature 1) from the current policy."""
        self.engine.sync(self.policy, self.version)
        p, ids = self.task.prompts(prompts, self.generator)
        return float(self._score(self._generate(p, ids, 2, self.config.max_new)).float().mean())

    def _generate(self, prompts: Tensor, ids: Tensor, group_size: int, max_new: int) -> Rollout:
        """The engine's rollouts of ``prompts``, the tool's replies written in on a multi-turn task."""
        tool = self.task.tool_span(prompts) if self.task.tool_at else None
        return self.engine.generate(prompts, ids, group_size, max_new, self.generator, tool, self.task.tool_at)

    def _score(self, rollout: Rollout) -> Tensor:
        """Correct, judged on the model's own tokens (the tool's reply removed)."""
        completions, lengths = self.task.model_part(rollout.completions, rollout.lengths, rollout.tool_mask)
        return self.task.score(rollout.prompts, completions, lengths)

    # ---- one GRPO step ----
    def step(self, step: int) -> StepReport:
        c, f = self.config, self.faults
        rollout = self._rollout()
        correct, rewards, components = self._rewards(rollout)
        t = rollout.completions.shape[1]
        positions = torch.arange(t).unsqueeze(0) < rollout.lengths.unsqueeze(1)
        tool = rollout.tool_mask
        model_positions = positions if tool is None else positions & ~tool  # the model's own tokens
        loss_mask = (torch.ones_like(positions) if f.mask_covers_padding
                     else positions if f.loss_on_tool_tokens else model_positions)
        lengths = rollout.lengths if tool is None or f.length_counts_tool_tokens else model_positions.sum(dim=1)
        if f.reuse_rollouts and self._reused_old is not None:
            old_logprobs, old_routing = self._reused_old  # the behaviour policy's, kept from its generation
        else:
            with torch.no_grad():
                old_logprobs, old_routing = self._old_logprobs(rollout)
            self._reused_old = (old_logprobs, old_routing) if f.reuse_rollouts else None
        advantages = group_advantages(rewards, c.group_size, f.advantage_wrong_groups)
        trainer_routing, engine_routing, replay = routing.observed(rollout, old_routing, self.task.prompt_length,
                                                                   c.routing_replay)

        self.monitor.observe_rollout(
            step, rewards=rewards, correct=correct, truncated=rollout.truncated, reward_components=components,
            rollout_logprobs=rollout.rollout_logprobs, old_logprobs=old_logprobs, loss_mask=model_positions,
            completion_lengths=lengths, completion_ids=rollout.completions, prompt_ids=rollout.prompt_ids,
            prompt_tokens=rollout.prompts, tool_mask=tool,
            generated_groups=self._filter.get("generated_groups"),
            filtered_all_correct_groups=self._filter.get("filtered_all_correct_groups"),
            filtered_all_incorrect_groups=self._filter.get("filtered_all_incorrect_groups"),
            routed_experts=trainer_routing, rollout_routed_experts=engine_routing, routing_replay=replay,
        )

        norms = self._update(step, rollout, old_logprobs, loss_mask, advantages, rewards, lengths)
        pre_clip, skipped = norms[-1], not all(math.isfinite(n) and n > 0 for n in norms)
        finite = [n for n in norms if math.isfinite(n)]
        self.engine.sync(self.policy, self.version)
        return StepReport(step, float(rewards.mean()), float(correct.float().mean()),
                          float(rollout.truncated.float().mean()), pre_clip, skipped,
                          float(correct.view(-1, c.group_size).any(dim=1).float().mean()), max(finite, default=0.0))

    def _update(self, step: int, rollout: Rollout, old_logprobs: Tensor, loss_mask: Tensor, advantages: Tensor,
                rewards: Tensor, lengths: Tensor) -> list[float]:
        """``epochs`` optimizer steps over the rollout, each accumulated over ``micro_batches``. A step whose
        pre-clip norm is not finite or exactly 0 is skipped, as real trainers do. Returns each one's pre-clip
        norm."""
        c = self.config
        size = rewards.shape[0] // c.micro_batches
        norms = []
        for _ in range(c.epochs):
            self.optimizer.zero_grad()
            for i in range(c.micro_batches):
                rows = slice(i * size, (i + 1) * size)
                self._micro_batch(step, rollout, rows, old_logprobs, loss_mask, advantages, rewards, lengths)
            limit = math.inf if c.max_grad_norm is None else c.max_grad_norm
            norms.append(float(self.monitor.clip_grad_norm_(self.policy.parameters(), limit)))
            if not math.isfinite(norms[-1]) or norms[-1] == 0.0:
                self.optimizer.zero_grad()
                continue
            self.optimizer.step(self.faults.lr_multiplier)
            self.version += 1
        return norms

    def _rewards(self, rollout: Rollout) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(correct, total reward, components) of the rollout, with the reward faults switched on."""
        return rewards_of(rollout, self._score(rollout), self.task, self.config, self.faults)

    def _micro_batch(self, step: int, rollout: Rollout, rows: slice, old_logprobs: Tensor, loss_mask: Tensor,
                     advantages: Tensor, rewards: Tensor, lengths: Tensor) -> None:
        """One micro-batch's clipped surrogate loss, backpropagated (scaled for the accumulation unless the
        fault leaves it undivided), and its tensors handed to the monitor."""
        c, f = self.config, self.faults
        logprobs, entropy, _ = self._logprobs(rollout, rows, replay=self._replay(rollout, rows))
        old = old_logprobs[rows].clone()
        if f.exp_before_clamp:  # a -inf sentinel from padding leaks into one loss token of each sequence
            old[:, 0] = -math.inf
        mask = loss_mask[rows]
        adv = advantages[rows].unsqueeze(1)
        per_token = loop.ppo_clip(logprobs - old, adv, c.clip_eps, c.log_ratio_clamp, f.exp_before_clamp)
        if f.entropy_penalty:  # an entropy *penalty* (a bonus with the wrong sign) sharpens the policy
            per_token = per_token + f.entropy_penalty * entropy
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(rollout, rows, model=self.reference, replay=self._replay(rollout, rows))[0]
            per_token = per_token + c.kl_coef * loop.kl_k3(logprobs, ref)
        loss = loop.aggregate(per_token, mask.float(), c.loss_aggregation, float(mask.shape[0] * mask.shape[1]))
        scale = (1.0 if f.loss_not_divided_by_accumulation else
                 float(c.micro_batches) if f.loss_times_accumulation else 1.0 / c.micro_batches)
        (loss * scale).backward()
        self.monitor.observe_update(
            step, logprobs=logprobs.detach(), old_logprobs=old, advantages=advantages[rows], loss_mask=mask,
            ref_logprobs=ref,
            entropy=entropy.detach(), on_policy=rollout.policy_version == self.version,
            policy_version=self.version, rollout_policy_version=rollout.policy_version,
            rewards=rewards[rows], completion_lengths=lengths[rows], completion_ids=rollout.completions[rows],
            tool_mask=None if rollout.tool_mask is None else rollout.tool_mask[rows],
        )

    def _rollout(self) -> Rollout:
        c, f = self.config, self.faults
        if f.reuse_rollouts and self._reused is not None:
            return self._reused
        e = self.engine
        e.frozen, e.top_p, e.temperature = f.engine_frozen, f.engine_top_p, f.engine_temperature
        e.skip_router = f.router_sync_skipped
        if c.dynamic_sampling:
            rollout, self._filter = dynamic_sampling.fill(
                lambda: self._generate(*self._prompts(c.prompts_per_step), c.group_size, f.max_new or c.max_new),
                lambda rollout: self._rewards(rollout)[0], c.prompts_per_step, c.group_size,
                c.dynamic_sampling_rounds)
        else:
            prompts, ids = self._prompts(c.prompts_per_step)
            rollout = self._generate(prompts, ids, c.group_size, f.max_new or c.max_new)
        self._reused = rollout if f.reuse_rollouts else None
        return rollout

    def _prompts(self, count: int) -> tuple[Tensor, Tensor]:
        """The step's prompts and ids: fresh from the task, or from the prompt_pool fault's fixed few."""
        pool = self.faults.prompt_pool
        if not pool:
            return self.task.prompts(count, self.generator)
        if self._pool is None or self._pool[0].shape[0] != pool:
            self._pool = self.task.prompts(pool, self.generator)
        pick = torch.randint(0, pool, (count,), generator=self.generator)
        return self._pool[0][pick], self._pool[1][pick]

    def _replay(self, rollout: Rollout, rows: slice) -> Tensor | None:
        return routing.replayed(rollout, rows, self.config.routing_replay, self.faults.replay_skipped_layer)

    def _old_logprobs(self, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
        """The behaviour policy's log-probs, recomputed by the trainer in ``old_logprob_rows`` rows a pass, and
        an MoE policy's routing in that pass (the experts it used: the engine's where it replays them)."""
        n = rollout.completions.shape[0]
        size = self.config.old_logprob_rows or n
        temperature = self.faults.old_logprob_temperature
        rows = [slice(i, i + size) for i in range(0, n, size)]
        passes = [self._logprobs(rollout, r, temperature, replay=self._replay(rollout, r)) for r in rows]
        routes = None if passes[0][2] is None else torch.cat([p[2] for p in passes if p[2] is not None])
        return torch.cat([p[0] for p in passes]), routes

    def _logprobs(self, rollout: Rollout, rows: slice = slice(None), temperature: float = 1.0,
                  model: TinyLM | None = None, replay: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Trainer-side per-token log-probs and entropies of the completions (log_softmax in fp32 of logits
        computed in ``trainer_precision``; ``temperature`` divides them, 1 but for the second-path fault) under
        the policy, or ``model`` (the KL term's reference), and an MoE model's routing of every fed position
        (``replay``: the engine's, replayed)."""
        prompts, completions = rollout.prompts[rows], rollout.completions[rows]
        sequence = torch.cat([prompts, completions], dim=1)
        lp = self.task.prompt_length
        bf16 = self.config.trainer_precision == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, routed = routing.forward(model or self.policy, sequence[:, :-1], replay)
        logp = torch.log_softmax(logits[:, lp - 1 :].float() / temperature, dim=-1)
        chosen = logp.gather(2, completions.unsqueeze(2)).squeeze(2)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        return chosen, entropy, routed


def group_advantages(rewards: Tensor, group_size: int, wrong_groups: bool = False) -> Tensor:
    """(r - group mean) / (group std + eps), unbiased std; ``wrong_groups``, the bug, takes the std of
    half-groups."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    if wrong_groups:  # the std of each half-group, the mean of the whole group
        half = group_size // 2
        std = rewards.view(-1, half).std(dim=1).repeat_interleave(half).view(-1, group_size)
    else:
        std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).flatten()


def warm_snapshot(config: DemoConfig) -> dict[str, object]:
    """The warm-started state for ``config`` (its seed decides it), for :meth:`Trainer.restore`: runs of one
    seed share one warm start (no monitor is involved before the first RL step). ``accuracy``: the sampled
    accuracy it reached."""
    trainer = Trainer(config, monitor=None)  # type: ignore[arg-type]
    accuracy = trainer.warm_start()
    return trainer.snapshot() | {"accuracy": accuracy}


__all__ = ["DemoConfig", "Faults", "StepReport", "Trainer", "group_advantages", "warm_snapshot"]
