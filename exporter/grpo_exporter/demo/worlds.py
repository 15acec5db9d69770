"""Tiny GRPO worlds unlike the demo's: a generator that varies what real runs vary, each world trained for real
with the demo's trainer (:meth:`World.config`) and watched by a real :class:`~grpo_exporter.GRPOMonitor`
(tests/worlds.py trains them and replays them through the production rules).

The axes: task family (one right answer; many; one whose length depends on the prompt; partial credit from
several reward components), warm-start strength (weak, medium, already solved), G (4, 8, 16), completion length
(short, long), engine precision (fp32, bf16) and cadence (20 s, 2 min, 10 min between steps); and the training
loop itself (:class:`Loop`): epochs per rollout (1, 2, 4), micro-batches accumulated per optimizer step (1, 4,
8), loss aggregation (token mean, sequence mean, Dr. GRPO's constant), optimizer (Adam, AdamW with weight decay,
SGD with momentum), learning rate (constant, warm-up), grad clip (0.5, 1, none) and KL in the loss or not.
:func:`world` enumerates them so that any 24 consecutive worlds cover every value of every axis.

A world is classified by the trainer's own measurements, never by the exporter's: its pass@1 (share of
correct rollouts) and pass@G (share of groups with a correct one) early and late in the run. The seed's
collapse is pass@k falling while pass@1 holds or rises (第 2 篇 (diversity monitoring) ③, 第 4 篇 (collapse
root causes)): such a world is ``collapsing``, and a layer-4 page there is right; every other fault-free world
is ``healthy``.

None of the enumerated families collapses: their tasks are learnable. :func:`collapse_world` adds the
``conflict`` family (two rules the policy cannot tell apart), in which GRPO's sharpening onto the majority
rule loses the samples that solved the other half of the prompts with nothing wrong: the seed's drift toward
collapse "even when nothing is wrong" (第 1 篇 (triage)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import fmean, median

import torch

from grpo_exporter.demo import loop
from grpo_exporter.demo.model import FP8
from grpo_exporter.demo.task import Task
from grpo_exporter.demo.trainer import DemoConfig

FAMILIES = {  # name -> (task kind, partial-credit weight)
    "unique": ("reverse", 0.0),
    "many": ("permute", 0.0),
    "length": ("distinct", 0.0),
    "partial": ("reverse", 0.5),
}
# not enumerated by world(): two rules the policy cannot tell apart (Task kind "conflict"), the family in which
# GRPO drifts to the seed's collapse with nothing wrong (collapse_world)
CONFLICT = "conflict"
CONFLICT_LR, CONFLICT_STEPS = 5e-4, 300  # the drift takes ~150 steps at 2.5x the others' learning rate
WARM = {"weak": 0.1, "medium": 0.4, "solved": 0.9}  # sampled accuracy the warm start stops at
GROUP_SIZES = (4, 8, 16)
LENGTHS = {"short": (3, 6), "long": (6, 10)}  # prompt symbols, max new tokens
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# not an axis of the enumeration (whose 200-world sweep stays comparable): an FP8 (W8A8) engine, as FP8 rollouts of
# large MoE models run, which tests/test_worlds.py gives worlds of their own
ENGINES = {**PRECISIONS, "fp8": FP8}
CADENCES = {"20s": 20.0, "2min": 120.0, "10min": 600.0}
# steps a world trains: past the rules' baselines and anchors at its cadence (1 h floors at 20 s; ~5 h at 10 min)
STEPS = {"20s": 300, "2min": 150, "10min": 80}
BATCH = 64  # completions a step: prompts = BATCH / G
EPOCHS = (1, 2, 4)
MICRO_BATCHES = (1, 4, 8)
AGGREGATIONS = loop.AGGREGATIONS
OPTIMIZERS = loop.OPTIMIZERS
SCHEDULES = {"constant": 0, "warmup": 20}  # optimizer steps of linear warm-up
CLIPS = {"0.5": 0.5, "1": 1.0, "none": None}
KL = {"off": 0.0, "on": 0.04}  # beta of the k3 KL to the warm-started policy (DeepSeekMath's GRPO: 0.04)
# the classification (the trainer's own pass@1 and pass@G, early and late fifths of the run)
# pass@G falls by more than this, absolute, and by more than COLLAPSE_STANDARD_ERRORS standard errors of the
# difference of the two fifths' means (the groups they hold decide), the standard of evidence the alerts apply
# (pass_drop_margin, 2 standard errors) ...
COLLAPSE_PASS_G_DROP = 0.05
COLLAPSE_STANDARD_ERRORS = 2.0
PASS_1_HOLD = 0.05  # ... while pass@1 falls less than this
# a step whose largest pre-clip norm (the trainer's own) is this many times the median of the run's non-zero ones:
# a gradient explosion by any reading (the field notes' danger sign is 10x), which a loop without a grad clip
# meets (SGD with momentum, a k3 KL term far from its reference). There the optimizer family's pages are right.
UNSTABLE_NORM_FACTOR = 100.0


@dataclass(frozen=True)
class Loop:
    """How a world trains on each rollout batch (values of the loop axes, keys of the tables above). The
    defaults are the demo's own loop (its clip: ``clip`` None); the conflict family and the named control
    worlds of tests/test_worlds.py train with it."""

    epochs: int = 1
    micro_batches: int = 4
    aggregation: str = "token"
    optimizer: str = "adam"
    schedule: str = "constant"
    clip: str | None = None
    kl: str = "off"

    @property
    def name(self) -> str:
        clip = f"{DemoConfig.max_grad_norm:g}" if self.clip is None else self.clip
        return (f"e{self.epochs}m{self.micro_batches}-{self.aggregation}-{self.optimizer}-{self.schedule}-"
                f"clip{clip}-kl{self.kl}")

    def settings(self) -> dict[str, object]:
        """The :class:`~grpo_exporter.demo.trainer.DemoConfig` fields of this loop."""
        clip = {} if self.clip is None else {"max_grad_norm": CLIPS[self.clip]}
        return {"epochs": self.epochs, "micro_batches": self.micro_batches, "loss_aggregation": self.aggregation,
                "optimizer": self.optimizer, "lr_warmup_steps": SCHEDULES[self.schedule], "kl_coef": KL[self.kl],
                **clip}


def loop_of(index: int) -> Loop:
    """The ``index``-th world's loop. Each axis is (index // d + index) mod its period, or a block of d worlds
    mod 2, with d small enough that any 24 consecutive indices hold every value."""
    return Loop(
        epochs=EPOCHS[(index // 5 + index) % 3],
        micro_batches=MICRO_BATCHES[(index // 8 + index) % 3],
        aggregation=AGGREGATIONS[(index // 9 + index) % 3],
        optimizer=OPTIMIZERS[(index // 4 + index) % 3],
        schedule=list(SCHEDULES)[(index // 3) % 2],
        clip=list(CLIPS)[(index // 10 + index) % 3],
        kl=list(KL)[(index // 7) % 2],
    )


@dataclass(frozen=True)
class World:
    index: int
    family: str
    warm: str
    group_size: int
    length: str
    precision: str
    cadence: str
    seed: int
    loop: Loop = field(default_factory=Loop)
    # not an axis of the enumeration: a bf16 trainer whose old log-probs are recomputed ``old_logprob_rows``
    # rows a pass (batch-variant numerics, the on-policy check's noise; tests/test_worlds.py)
    trainer: str = "fp32"
    old_logprob_rows: int | None = None
    # not an axis either: a mixture-of-experts policy of this many experts a layer, top-2 (tests/test_worlds.py)
    experts: int = 0

    @property
    def name(self) -> str:
        extra = f"-trainer-{self.trainer}" if self.trainer != "fp32" else ""
        extra += f"-rows{self.old_logprob_rows}" if self.old_logprob_rows is not None else ""
        extra += f"-moe{self.experts}" if self.experts else ""
        return (f"w{self.index:03d}-{self.family}-{self.warm}-g{self.group_size}-{self.length}-{self.precision}-"
                f"{self.cadence}-{self.loop.name}{extra}")

    @property
    def cadence_s(self) -> float:
        return CADENCES[self.cadence]

    @property
    def steps(self) -> int:
        return CONFLICT_STEPS if self.family == CONFLICT else STEPS[self.cadence]

    def config(self) -> DemoConfig:
        kind, partial = {**FAMILIES, CONFLICT: (CONFLICT, 0.0)}[self.family]
        symbols_in_prompt, max_new = LENGTHS[self.length]
        return DemoConfig(
            seed=self.seed, prompts_per_step=BATCH // self.group_size, group_size=self.group_size, max_new=max_new,
            warmup_steps=1500 if self.warm == "solved" else 600, warmup_target=WARM[self.warm],
            partial_weight=partial, engine_precision=ENGINES[self.precision],
            trainer_precision=PRECISIONS[self.trainer], old_logprob_rows=self.old_logprob_rows, experts=self.experts,
            task=Task(symbols=6, length=symbols_in_prompt, kind=kind),
            lr=CONFLICT_LR if self.family == CONFLICT else DemoConfig.lr, **self.loop.settings(),  # type: ignore[arg-type]
        )


def world(index: int) -> World:
    """The ``index``-th world. Axis periods 4, 3, 3 (offset), 2, 2 (offset) and 3 (offset) make every 24
    consecutive worlds cover each value of each axis, and (family, warm start) every one of its 12 pairs."""
    return World(
        index=index,
        family=list(FAMILIES)[index % 4],
        warm=list(WARM)[index % 3],
        group_size=GROUP_SIZES[(index // 3 + index) % 3],
        length=list(LENGTHS)[(index // 4) % 2],
        precision=list(PRECISIONS)[(index // 2 + index // 8) % 2],
        cadence=list(CADENCES)[(index // 12 + index) % 3],
        seed=1000 + index,
        loop=loop_of(index),
    )


COLLAPSE_INDEX = 1000  # collapse_world(i) is world index COLLAPSE_INDEX + i


def collapse_world(index: int) -> World:
    """The ``index``-th world of the conflict family: medium warm start, short completions, G 8 or 16, each
    engine precision and cadence (period 2, 2, 3: every 12 consecutive ones cover each pair of them). Its
    class still comes from its own pass@1 and pass@G; most of them collapse (pass@G falls by 0.1-0.2 while
    pass@1 rises from ~0.4 to ~0.6), a few may not within their steps."""
    return World(
        index=COLLAPSE_INDEX + index,
        family=CONFLICT,
        warm="medium",
        group_size=(8, 16)[index % 2],
        length="short",
        precision=list(PRECISIONS)[(index // 2) % 2],
        cadence=list(CADENCES)[index % 3],
        seed=2000 + index,
    )


@dataclass
class Trajectory:
    """The trainer's own measurements of a world, per step, and its class."""

    world: World
    warm_accuracy: float
    pass_at_1: list[float] = field(default_factory=list)
    pass_at_group: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # each step's largest pre-clip norm, the trainer's own

    def _fifth(self, values: list[float], late: bool) -> float:
        k = max(1, len(values) // 5)
        return fmean(values[-k:] if late else values[:k])

    @property
    def early(self) -> tuple[float, float]:
        """(pass@1, pass@G) over the first fifth of the steps."""
        return self._fifth(self.pass_at_1, False), self._fifth(self.pass_at_group, False)

    @property
    def late(self) -> tuple[float, float]:
        """(pass@1, pass@G) over the last fifth of the steps."""
        return self._fifth(self.pass_at_1, True), self._fifth(self.pass_at_group, True)

    @property
    def pass_at_group_fall_error(self) -> float:
        """The standard error of the difference between pass@G's early and late fifth means: each a share of
        the groups of its fifth, sqrt(p(1-p)/groups) added in quadrature."""
        (_, early), (_, late) = self.early, self.late
        return self._fall_error(early, late)

    @property
    def pass_at_1_fall_error(self) -> float:
        """As :attr:`pass_at_group_fall_error`, for pass@1, counting groups rather than completions (the
        completions of one prompt are not independent samples)."""
        (early, _), (late, _) = self.early, self.late
        return self._fall_error(early, late)

    def _fall_error(self, early: float, late: float) -> float:
        groups = max(1, len(self.pass_at_group) // 5) * (BATCH // self.world.group_size)
        return math.sqrt((early * (1 - early) + late * (1 - late)) / groups)

    @property
    def unstable(self) -> bool:
        """Whether a step's pre-clip norm reached UNSTABLE_NORM_FACTOR times the median of the run's non-zero
        norms: the trainer measured a gradient explosion."""
        norms = [n for n in self.grad_norms if n > 0 and math.isfinite(n)]
        return bool(norms) and max(norms) > UNSTABLE_NORM_FACTOR * median(norms)

    @property
    def kind(self) -> str:
        """``collapsing`` when pass@G fell clearly (beyond COLLAPSE_PASS_G_DROP and its sampling error) while
        pass@1 held or rose; ``degrading`` when pass@1 itself fell clearly (beyond PASS_1_HOLD and its sampling
        error): the run got worse at its own task, a training crash the trainer measured, which any layer may
        page; else ``healthy``."""
        (p1_early, pg_early), (p1_late, pg_late) = self.early, self.late
        if p1_early - p1_late > max(PASS_1_HOLD, COLLAPSE_STANDARD_ERRORS * self.pass_at_1_fall_error):
            return "degrading"
        falls = pg_early - pg_late > max(COLLAPSE_PASS_G_DROP,
                                         COLLAPSE_STANDARD_ERRORS * self.pass_at_group_fall_error)
        holds = p1_late >= p1_early - PASS_1_HOLD
        return "collapsing" if falls and holds else "healthy"


__all__ = ["AGGREGATIONS", "CADENCES", "CLIPS", "COLLAPSE_INDEX", "CONFLICT", "ENGINES", "EPOCHS", "FAMILIES",
           "GROUP_SIZES",
           "KL", "LENGTHS", "MICRO_BATCHES", "OPTIMIZERS", "PRECISIONS", "SCHEDULES", "WARM", "Loop", "Trajectory",
           "World", "collapse_world", "loop_of", "world"]
