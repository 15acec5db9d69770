"""Production cadence, replayed: a real GRPOMonitor driven step by step by a simulated GRPO run, its scrapes
every 30 s written as promtool input series, and the production rules judged on them by promtool.

A run here is not the demo: prompts come from a fixed pool of spread difficulty (each prompt's solve rate is
logistic around the run's mean), several micro-steps make an optimizer step (the first on-policy), grad
norms are log-normal, completions are ragged. Knobs (:class:`Knobs`) move one property at a time so a
scenario is a function of the hour: a healthy run, a slow collapse, a clip storm, a one-step spike.

The verdict is read from Prometheus' own ``ALERTS`` series inside promtool: which alerts fired, how many
separate episodes each had (once, not flapping), and when each first fired against its fault's onset.
"""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import yaml

from batch_lane import LANE_WAIT_S
from grpo_exporter import GRPOMonitor, MonitorConfig
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.render import rules_outputs

SCRAPE_S = 30
# rule evaluation every minute: Prometheus' default evaluation_interval (ours in deploy/ is 15 s); every replay's
# promtool time is its evaluations x its rules, and at twice the scrape interval it is half that at 30 s
EVAL_S = 60
JOB, INSTANCE = "grpo", "trainer:9887"
# separate firing episodes per alert and run (per target for the alerts of a target, which carry no run): a
# test-only recording rule marks each evaluation where an alert fires and did not one evaluation before (a
# subquery over every ALERTS series would exceed promtool's limit); the dead man's switch, GRPOWatchdog, fires
# throughout by design and is no episode (rules/tests/layer1.test.yml checks it)
FIRING = 'ALERTS{alertstate="firing",alertname!="GRPOWatchdog"}'
EPISODE_RULES = {"groups": [{"name": "replay-episodes", "rules": [{
    "record": "replay:alert_starts",
    "expr": f'label_join(group by (alertname, run, instance) ({FIRING}) unless '
            'on(alertname, run, instance) group by (alertname, run, instance) '
            f'({FIRING} offset {EVAL_S}s), "pair", "/", "alertname", "run")',
}]}]}


@dataclass(frozen=True)
class Knobs:
    """One step's properties; the defaults are a healthy mid-training step."""

    solve: float = 0.5  # mean solve rate of the prompt pool
    entropy: float = 1.0  # mean token entropy, nats
    clip_share: float = 0.0  # share of off-policy signed tokens pushed beyond the clip band
    grad_norm: float = 1.0  # median pre-clip grad norm (max_grad_norm 5)
    staleness: int = 0  # policy versions between the rollout and the update
    distinct: float = 1.0  # share of a group's completions that are distinct
    same_answer: float = 0.0  # share of groups whose samples all repeat their first sample's outcome (collapse)
    wrong_repeat: float = 0.0  # share of all-wrong groups whose samples repeat one wrong completion (no outcome moves)
    verifier_zero: bool = False  # the verifier scores this batch 0 (one noisy batch)
    onpolicy_noise: float = 1e-5  # sd of the on-policy recomputation |log r|
    engine_gap: float = 1e-4  # sd of rollout vs trainer log-probs
    bf16_engine: bool = False  # a bf16 engine's noise: heavy-tailed, zero-mean to first order (mean |gap| ~0.016)
    fp8_engine: bool = False  # an FP8 (W8A8) engine's: heavier (mean |gap| ~0.05, k3 ~0.004: NeMo-RL's healthy FP8)
    engine_shift: float = 0.0  # added to every engine log-prob: -log(kept mass) of top-p renormalisation
    engine_temperature: float = 1.0  # the engine samples and reports at this temperature; the trainer at 1
    engine_logit_sd: float = 0.0  # the engine's logits differ per position by this sd (stale or partial weights)
    log_ratio_sd: float = 0.03  # sd of off-policy log ratios (large: a few tokens carry the importance weight)
    lower_only: float = 0.0  # share of negative-advantage off-policy tokens pushed below the clip, nothing up
    nan_token: bool = False  # one loss token's log-prob is NaN
    mask_padding: bool = False  # the loss mask covers one padding position per sequence
    advantage_scale: float = 1.0  # advantages multiplied after group normalisation
    truncated: float = 0.0  # share of completions cut at the maximum length
    longer_correct: int = 0  # tokens added to correct completions (a length hack)
    longer_incorrect: int = 0  # tokens added to incorrect completions (1/|o| loss aggregation)
    format_pays: float = 0.1  # the "format" reward component, paid to every completion
    format_jitter: float = 0.0  # width of a uniform noise term in the format component (a float scorer's jitter)
    retrieval: float = 0.9  # share of completions that score highest under their own prompt
    regression: float = 0.95  # accuracy on the mastered-prompt regression set (64 completions every 5 steps)
    dynamic_sampling: bool = False  # DAPO: zero-variance groups dropped, drawn on until the batch is full
    kl_ref: float = 0.0  # the KL (k3) of every loss token to a reference policy, nats; 0: no reference log-probs


REGRESSION_EVERY, REGRESSION_SET = 5, 64  # the mastered-prompt regression set: every 5 steps, 64 completions
Scenario = Callable[[int, float], Knobs]  # (step, hours since the start) -> the step's knobs


class SimulatedRun:
    """Batches of a GRPO run: 16 prompts x 8 samples per step from a pool of 512, ragged completions."""

    def __init__(self, seed: int, prompts: int = 16, group_size: int = 8, width: int = 12) -> None:
        self.rng = np.random.default_rng(seed)
        self.held_rng = np.random.default_rng(seed + 1_000_003)  # the regression set's own draws
        self.prompts, self.group_size, self.width = prompts, group_size, width
        self.difficulty = self.rng.normal(0.0, 1.5, size=512)  # fixed per prompt: spread solve rates
        self.collapsed = 0.0  # the share of the last batch's groups that repeat one outcome (Knobs.same_answer)

    def _draw(self, k: Knobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One generation batch: its prompts, each completion's correctness, and which groups collapsed."""
        rng, g = self.rng, self.group_size
        ids = rng.choice(len(self.difficulty), size=self.prompts, replace=False)
        logit = math.log(k.solve / (1 - k.solve)) + self.difficulty[ids]
        p = np.repeat(1 / (1 + np.exp(-logit)), g)
        n = len(p)
        correct = rng.random(n) < p
        first = np.repeat(correct.reshape(-1, g)[:, 0], g)
        # a collapsed group repeats its first sample, again and again; the draw per sample keeps every
        # scenario's random stream, a group reads its first
        groups = rng.random(n).reshape(-1, g)[:, 0] < k.same_answer
        self.collapsed = float(groups.mean())
        return ids, np.where(np.repeat(groups, g), first, correct), groups

    def _filled(self, k: Knobs) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
        """A DAPO batch: generation batches drawn until ``prompts`` groups with both outcomes are kept (at most
        64 batches; a pool that cannot fill it is topped up with filtered groups), and the filter's counts."""
        g, kept_ids, kept, kept_same = self.group_size, [], [], []
        counts = {"generated_groups": 0, "filtered_all_correct_groups": 0, "filtered_all_incorrect_groups": 0}
        for _ in range(64):
            ids, correct, same = self._draw(k)
            hits = correct.reshape(-1, g).sum(axis=1)
            counts["generated_groups"] += len(ids)
            counts["filtered_all_correct_groups"] += int((hits == g).sum())
            counts["filtered_all_incorrect_groups"] += int((hits == 0).sum())
            mixed = (hits > 0) & (hits < g)
            kept_ids += list(ids[mixed])
            kept += list(correct.reshape(-1, g)[mixed])
            kept_same += list(same[mixed])
            if len(kept_ids) >= self.prompts:
                break
        short = self.prompts - len(kept_ids)
        if short > 0:
            kept_ids += list(ids[:short])
            kept += list(correct.reshape(-1, g)[:short])
            kept_same += list(same[:short])
        return (np.array(kept_ids[:self.prompts]), np.concatenate(kept[:self.prompts]),
                np.array(kept_same[:self.prompts], dtype=bool), counts)

    def step(self, mon: GRPOMonitor, step: int, k: Knobs) -> None:
        rng, g, width = self.rng, self.group_size, self.width
        counts: dict[str, int] = {}
        if k.dynamic_sampling:
            ids, correct, same, counts = self._filled(k)
        else:
            ids, correct, same = self._draw(k)
        n = len(correct)
        if k.wrong_repeat:  # drawn only when set: the other runs' draws stay as they were
            wrong = correct.reshape(-1, g).sum(axis=1) == 0
            same = same | (wrong & (rng.random(len(wrong)) < k.wrong_repeat))
        correctness = np.zeros(n) if k.verifier_zero else correct.astype(float)
        fmt = np.full(n, k.format_pays)
        if k.format_jitter:  # drawn only when set: the other runs' draws stay as they were
            fmt = fmt + k.format_jitter * rng.random(n)
        rewards = correctness + fmt
        grouped = rewards.reshape(-1, g)
        std = grouped.std(axis=1, ddof=1, keepdims=True)
        adv = np.where(std > 0, (grouped - grouped.mean(axis=1, keepdims=True)) / (std + 1e-4), 0.0).reshape(-1)
        lengths = rng.integers(4, width - 4, size=n) + np.where(correct, k.longer_correct, k.longer_incorrect)
        cut = rng.random(n) < k.truncated
        lengths = np.where(cut, width, lengths)
        adv = adv * k.advantage_scale
        distinct = max(1, round(k.distinct * g))
        templates = rng.integers(4, 40, size=(self.prompts, distinct, width))
        pick = np.concatenate([rng.permutation(np.arange(g) % distinct) for _ in range(self.prompts)])
        # one completion per (group, template), token for token: a copy of a template takes its first member's
        # length and cut, and a collapsed group's samples are all its first sample's (drawn above, in order)
        source = np.arange(n).reshape(-1, g)
        twin = (pick.reshape(-1, g)[:, :, None] == pick.reshape(-1, g)[:, None, :]).argmax(axis=2)
        source = np.where(np.repeat(same, g).reshape(-1, g), source[:, :1], np.take_along_axis(source, twin, 1))
        source = source.reshape(-1)
        lengths, cut, pick = lengths[source], cut[source], pick[source]
        mask = np.arange(width)[None, :] < lengths[:, None]
        loss_mask = mask | (np.arange(width)[None, :] == lengths[:, None]) if k.mask_padding else mask
        completion_ids = np.where(mask, templates[np.repeat(np.arange(self.prompts), g), pick], 0)
        old = np.log(rng.uniform(0.3, 0.8, size=(n, width)))
        rollout = old + rng.normal(0.0, k.engine_gap, size=old.shape)
        if k.engine_temperature != 1.0 or k.engine_logit_sd:
            # a two-token world per position: the engine's distribution q differs from the trainer's p, and the
            # engine samples the token (so mean(rollout - old) estimates KL(q || p) > 0, as in a real run)
            p_hi = rng.uniform(0.3, 0.8, size=old.shape)
            z = np.log(p_hi / (1 - p_hi)) / k.engine_temperature + k.engine_logit_sd * rng.standard_normal(old.shape)
            q_hi = 1 / (1 + np.exp(-z))
            hi = rng.random(old.shape) < q_hi
            old = np.where(hi, np.log(p_hi), np.log1p(-p_hi))
            rollout = np.where(hi, np.log(q_hi), np.log1p(-q_hi))
        if k.bf16_engine:
            # TRL #6789's per-token shape: 15% of tokens carry most of it (sd 0.047, p95 ~0.1, mean |gap| ~0.016);
            # sampling from the engine adds the second-order KL, noise^2 / 2
            tail = rng.random(old.shape) < 0.15
            noise = np.where(tail, rng.normal(0.0, 0.12, old.shape), rng.normal(0.0, 0.003, old.shape))
            rollout = rollout + noise + 0.5 * noise**2
        if k.fp8_engine:
            # the demo's FP8 engine (grpo_exporter.demo.model.fp8_linear) against its fp32 trainer: mean |gap|
            # 0.05-0.08, k3 0.003-0.006 per rollout; NeMo-RL's healthy FP8 Qwen3.5 reads gen-KL 0.0014-0.0050 (20-step
            # means; its gates 0.003-0.004). 30% of tokens carry most of it
            tail = rng.random(old.shape) < 0.3
            noise = np.where(tail, rng.normal(0.0, 0.16, old.shape), rng.normal(0.0, 0.02, old.shape))
            rollout = rollout + noise + 0.5 * noise**2
        rollout = rollout + k.engine_shift
        entropy = k.entropy * rng.uniform(0.5, 1.5, size=old.shape)
        on_rows = n // 4
        new = old + rng.normal(0.0, k.log_ratio_sd, size=old.shape)
        pushed = rng.random(old.shape) < k.clip_share
        new = np.where(pushed, old + 0.35 * np.sign(adv)[:, None], new)
        down = (rng.random(old.shape) < k.lower_only) & (adv < 0)[:, None]
        new = np.where(down, old - 0.35, new)
        if k.nan_token:
            new[on_rows, 0] = np.nan
        new[:on_rows] = old[:on_rows] + rng.normal(0.0, k.onpolicy_noise, size=(on_rows, width))

        def t(a: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.as_tensor(a, dtype=dtype)

        mon.observe_rollout(
            step, rewards=t(rewards), correct=t(correct, torch.bool), rollout_logprobs=t(rollout),
            old_logprobs=t(old), loss_mask=t(mask, torch.bool), completion_lengths=t(lengths, torch.long),
            truncated=t(cut, torch.bool),
            reward_components={"correctness": t(correctness), "format": t(fmt)},
            completion_ids=t(completion_ids, torch.long), prompt_ids=t(np.repeat(ids, g), torch.long), **counts,
        )
        # a collapsed group has no reward variance and gives no gradient: the norm shrinks with their share, as a
        # real one does (GRPOGradNormSpike judges it per share of tokens with an advantage)
        pre = k.grad_norm * float(np.exp(rng.normal(0.0, 0.2))) * max(1.0 - self.collapsed, 1.0 / self.prompts)
        scalars = {"policy_version": step, "rollout_policy_version": step - k.staleness,
                   "grad_norm_pre_clip": pre, "grad_norm_post_clip": min(pre, 5.0), "max_grad_norm": 5.0}
        ref = {}
        if k.kl_ref:
            # ref - logp = d with exp(d) - d - 1 = kl_ref on every token (d > 0), by Newton from d = sqrt(2 kl)
            d = math.sqrt(2 * k.kl_ref)
            for _ in range(20):
                d -= (math.expm1(d) - d - k.kl_ref) / math.expm1(d)
            ref = {"ref_logprobs": new + d}
        for rows, on_policy in ((slice(0, on_rows), True), (slice(on_rows, n), False)):
            more = {name: t(value[rows]) for name, value in ref.items()}
            mon.observe_update(
                step, logprobs=t(new[rows]), old_logprobs=t(old[rows]), advantages=t(adv[rows]),
                loss_mask=t(loss_mask[rows], torch.bool), entropy=t(entropy[rows]), on_policy=on_policy,
                completion_lengths=t(lengths[rows], torch.long), **scalars, **more,
            )
        mon.end_step()
        own = np.repeat(np.arange(self.prompts), g)
        scores = rng.normal(0.0, 1.0, size=(n, self.prompts))
        hit = rng.random(n) < k.retrieval
        scores[np.arange(n), own] = np.where(hit, scores.max(axis=1) + 1.0, scores.min(axis=1) - 1.0)
        mon.observe_retrieval(step, t(scores), t(own, torch.long))
        if step % REGRESSION_EVERY == 0:
            mon.observe_regression(step, t(self.held_rng.random(REGRESSION_SET) < k.regression, torch.bool))
        mon.wait_for_workers(timeout=LANE_WAIT_S)


@dataclass
class Segment:
    """One run of the replay: ``hours`` of steps every ``cadence_s`` from ``start_s``, ending with close()
    (a normal end) or not (the process dies)."""

    run: str
    scenario: Scenario
    hours: float
    start_s: float = 0.0
    closed: bool = True
    seed: int = 0
    instance: str = INSTANCE  # its scrape target; runs on one target follow each other
    monitor: dict[str, object] = field(default_factory=dict)  # more MonitorConfig settings
    prompts: int = 16  # groups a step
    group_size: int = 8


@dataclass
class Timeline:
    """Scrapes every 30 s: series -> value per scrape (None: no sample)."""

    scrapes: int
    series: dict[str, list[float | None]] = field(default_factory=dict)

    def put(self, index: int, values: dict[str, float]) -> None:
        series = self.series
        for key, value in values.items():
            column = series.get(key)
            if column is None:  # a new series: its column of scrapes is made once, not at every put
                column = series[key] = [None] * self.scrapes
            column[index] = value


def _exposed(mon: GRPOMonitor, keep: set[str], clock: float, instance: str) -> dict[str, float]:
    """What a scrape of ``mon`` sees of the series the rules read (straight from the registry's collectors, as
    the exposition writes them; ~50x faster than writing and parsing it), the last step's timestamp at the
    replay's clock."""
    out: dict[str, float] = {}
    for family in mon.registry.collect():
        for sample in family.samples:
            if sample.name not in keep:
                continue
            value = clock if sample.name == "grpo_last_step_timestamp_seconds" else sample.value
            labels = {"job": JOB, "instance": instance, **sample.labels}
            body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[f"{sample.name}{{{body}}}"] = value
    return out


def rule_metric_names(mixin: MixinConfig) -> set[str]:
    """Every metric the rules read (the replay writes only those: promtool's cost is per series)."""
    text = "\n".join(rules_outputs(mixin).values())
    return set(re.findall(r"\bgrpo_[a-z0-9_]+", text)) | {"up"}


def replay(mixin: MixinConfig, cadence_s: float, segments: list[Segment], total_hours: float) -> Timeline:
    """Drive a real monitor per segment; every scrape sees the state after the last step before it."""
    keep = rule_metric_names(mixin)
    scrapes = int(total_hours * 3600 // SCRAPE_S)
    timeline = Timeline(scrapes)
    for seg in segments:
        up = f'up{{instance="{seg.instance}",job="{JOB}"}}'
        sim = SimulatedRun(seg.seed, prompts=seg.prompts, group_size=seg.group_size)
        config = MonitorConfig(**({"run": seg.run, "group_size": seg.group_size, "port": None, "guard": "off",
                                   "close_linger_s": 0.0, "edit_distance_groups": 4} | seg.monitor))
        mon = GRPOMonitor(config=config)
        steps = int(seg.hours * 3600 // cadence_s)
        first = math.ceil(seg.start_s / SCRAPE_S)
        last_clock = seg.start_s
        for step in range(steps + 1):
            clock = seg.start_s + step * cadence_s
            if step < steps:
                sim.step(mon, step, seg.scenario(step, step * cadence_s / 3600))
                last_clock, end = clock, clock + cadence_s
            elif seg.closed:
                mon.close()  # grpo_run_finished 1: one more scrape sees it, then the target is gone
                end = clock + SCRAPE_S
            else:
                break  # the process dies: its scrapes fail from here
            state = _exposed(mon, keep, last_clock, seg.instance)
            for i in range(max(first, math.ceil(clock / SCRAPE_S)), min(scrapes, math.ceil(end / SCRAPE_S))):
                timeline.put(i, state | {up: 1.0})
        last = max(i for i, v in enumerate(timeline.series[up]) if v is not None)
        nxt = [s.start_s for s in segments if s.start_s > seg.start_s and s.instance == seg.instance]
        stop = min(scrapes, math.ceil(min(nxt) / SCRAPE_S)) if nxt else scrapes
        for i in range(last + 1, stop):
            timeline.series[up][i] = 0.0  # a static target: the process is gone, its scrapes fail
    return timeline


def _encode(values: list[float | None]) -> str:
    """promtool expanding notation, run-length encoded; the first missing scrape after a sample is a stale
    marker (a failed scrape ends the series at once, as in Prometheus)."""
    out: list[str] = []
    i, last = 0, None
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        run = j - i
        if values[i] is None:
            if last is not None:
                out.append("stale")
                run -= 1
            if run:
                out.append(f"_x{run}")
        else:
            out.append(repr(values[i]) if run == 1 else f"{values[i]!r}+0x{run - 1}")
        last = values[i]
        i = j
    return " ".join(out)


@dataclass(frozen=True)
class Expect:
    """An alert that must fire exactly once, first within [onset_s + for, onset_s + within_s]."""

    alert: str
    onset_s: float
    within_s: float
    run: str | None = None  # with several runs: the run it must fire for (and for no other)


def promtool_test(mixin: MixinConfig, timeline: Timeline, expect: Iterable[Expect], folder: Path,
                  name: str, may_fire: Iterable[tuple[str, str]] = ()) -> subprocess.CompletedProcess[str]:
    """Write the rules and one promtool test over the timeline; run it. Fails unless exactly the expected
    alerts fired, each in one episode, each first firing no earlier than its ``for`` after its onset and no
    later than ``within_s`` after it. ``may_fire``: (alert, run) pairs that are true signals of a fault but
    depend on timing (they are neither required nor counted)."""
    expect = list(expect)
    by = "alertname, run" if any(e.run for e in expect) else "alertname"
    pairs = "|".join(f"{alert}/{run}" for alert, run in may_fire)
    selector = f'pair!~"{pairs}"' if pairs else ""
    return _promtool(mixin, timeline, _expect_tests(mixin, timeline, expect, by, [selector]), folder, name)


CASE = re.compile(r"[a-z0-9][a-z0-9-]*")


def case_run(case: str, run: str) -> str:
    """The run label of ``run`` of ``case`` when several cases share one replay."""
    return f"{case}/{run}"


def promtool_cases(mixin: MixinConfig, timeline: Timeline, cases: dict[str, list[Expect]], folder: Path,
                   name: str) -> subprocess.CompletedProcess[str]:
    """:func:`promtool_test` for several cases replayed side by side in one timeline (their runs labelled
    :func:`case_run`): each case's expectations are read from its own runs only, so one promtool run judges
    them all (its cost is mostly evaluations x rules, shared by the cases); :func:`failed_cases` says which
    failed."""
    tests = []
    for case, expect in cases.items():
        assert CASE.fullmatch(case), case
        # a run's alerts, or its target's (GRPOExporterDown carries the instance, no run)
        selectors = [f'run=~"{case_run(case, ".*")}"', f'run="",instance=~"{case_run(case, ".*")}"']
        tests += _expect_tests(mixin, timeline, [replace(e, run=None) for e in expect], "alertname", selectors)
    return _promtool(mixin, timeline, tests, folder, name)


def failed_cases(done: subprocess.CompletedProcess[str], cases: Iterable[str]) -> dict[str, list[str]]:
    """case -> the expressions promtool reports as failed for it; every case, with the whole output, when
    promtool failed without naming an expression of any (a rule file that does not load, a crash)."""
    text = done.stdout + done.stderr
    blocks = re.split(r"\n(?=\s*expr: )", text)
    found: dict[str, list[str]] = {}
    for case in cases:
        marker = f'run=~\\"{case_run(case, ".*")}\\"'
        found[case] = [b.strip() for b in blocks if b.lstrip().startswith("expr: ") and marker in b]
    if done.returncode != 0 and not any(found.values()):
        return {case: [text[-4000:]] for case in cases}
    return {case: failed for case, failed in found.items() if failed}


def _expect_tests(mixin: MixinConfig, timeline: Timeline, expect: list[Expect], by: str,
                  selectors: list[str]) -> list[dict[str, object]]:
    """The promtool expressions of :func:`promtool_test` for ``expect``, over the ALERTS of the series that
    any of ``selectors`` (label matchers, "" for all) picks."""
    end = timeline.scrapes * SCRAPE_S
    fors = {r["alert"]: _seconds(r["for"]) for doc in rules_outputs(mixin).values()
            for g in yaml.safe_load(doc)["groups"] for r in g["rules"] if "alert" in r}

    def labels(e: Expect) -> str:
        return f'{{alertname="{e.alert}"' + (f',run="{e.run}"}}' if e.run else "}")

    starts = " or ".join(f"sum_over_time(replay:alert_starts{{{s}}}[{end}s])" for s in selectors)
    tests: list[dict[str, object]] = [{
        "expr": f"sum by ({by}) ({starts})",
        "eval_time": f"{end}s",
        "exp_samples": [{"labels": labels(e), "value": 1} for e in expect],
    }]
    for e in expect:
        run = f',run="{e.run}"' if e.run else ""
        firing = " or ".join(f'ALERTS{{alertname="{e.alert}",alertstate="firing"{run}{"," + s if s else ""}}}'
                             for s in selectors)
        first = f"min(min_over_time(timestamp({firing})[{end}s:{EVAL_S}s]))"
        low, high = e.onset_s + fors[e.alert], e.onset_s + e.within_s
        tests.append({
            "expr": f"({first} >= {low:g} and {first} <= {high:g}) * 0 + 1",
            "eval_time": f"{end}s",
            "exp_samples": [{"labels": "{}", "value": 1}],
        })
    return tests


def _promtool(mixin: MixinConfig, timeline: Timeline, tests: list[dict[str, object]], folder: Path,
              name: str) -> subprocess.CompletedProcess[str]:
    """Write the rules, the episode rule and one promtool test of ``tests`` over the timeline; run it."""
    for file, text in rules_outputs(mixin).items():
        (folder / file).write_text(text)
    (folder / "replay-episodes.rules.yml").write_text(yaml.safe_dump(EPISODE_RULES, sort_keys=False))
    doc = {
        "rule_files": [*sorted(rules_outputs(mixin)), "replay-episodes.rules.yml"],
        "evaluation_interval": f"{EVAL_S}s",
        "group_eval_order": ["grpo-recording", "grpo-alerts", "replay-episodes"],
        "tests": [{
            "name": name,
            "interval": f"{SCRAPE_S}s",
            "input_series": [{"series": k, "values": _encode(v)} for k, v in sorted(timeline.series.items())],
            "promql_expr_test": tests,
        }],
    }
    path = folder / f"{name}.test.yml"
    path.write_text(yaml.safe_dump(doc, width=1 << 30, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", path.name], cwd=folder, capture_output=True, text=True,
                          timeout=1800)


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return float(sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", duration)))


def healthy(step: int, hours: float) -> Knobs:
    """A run that learns: the solve rate climbs from 0.3 to 0.7 over the day, entropy eases 1.0 -> 0.8."""
    progress = min(1.0, hours / 24)
    return Knobs(solve=0.3 + 0.4 * progress, entropy=1.0 - 0.2 * progress)


def after(onset_h: float, base: Scenario, **fault: object) -> Scenario:
    """``base``, with ``fault`` knobs from ``onset_h`` hours on."""
    return lambda step, hours: replace(base(step, hours), **fault) if hours >= onset_h else base(step, hours)
