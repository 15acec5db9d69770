"""The metric catalogue: every metric family grpo-exporter publishes, as data.

This module is the single source of truth. The step computation checks its keys against it, the collector
builds its families from it, and the rules, dashboards and metric reference are generated from it. It imports
nothing of ours.

Conventions (binding, checked by :func:`validate` at import time):

* names start with ``grpo_``, use ``[a-z0-9_]``, and end with their base unit (``_nats``, ``_tokens``,
  ``_seconds``...); counters and only counters end in ``_total``; values confined to 0..1 end in ``_ratio``;
* every label has a bounded set of values: either listed here, or bounded by a named config knob;
* the ``run`` label is added to every series by the collector and is not listed per metric.

Layers are the seed's signal chain ("信号链四问"): a failure in a layer makes every layer behind it meaningless.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from enum import StrEnum


class MetricType(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    SUMMARY = "summary"
    HISTOGRAM = "histogram"


class Layer(StrEnum):
    """Signal-chain layer, used verbatim as the ``layer`` label of alerts."""

    LIVENESS = "0-liveness"
    GRADIENT = "1-gradient"
    REWARD = "2-reward"
    SAMPLES = "3-samples"
    DIVERSITY = "4-diversity"


class Merge(StrEnum):
    """How one sample combines across data-parallel ranks (the catalogue's ``dist_reduce_fx``).

    Counters and the ``_sum``/``_count``/``_bucket`` samples always ``sum``; summary quantiles always come from
    the summed fine ``histogram``; every gauge the step computes declares its merge; the monitor's own gauges stay
    ``local``. :mod:`grpo_exporter.ranks.distributed` implements each kind once.
    """

    SUM = "sum"  # add the ranks' values
    RATIO = "ratio"  # add numerators and denominators, then divide
    MAX = "max"  # the largest of the ranks' extremes
    SAME = "same"  # a value every rank computes alike (the global grad norm): the largest, to be safe
    ESS = "ess"  # (sum w)^2 / sum w^2 / n from the ranks' weight sums, rescaled to a common shift
    HISTOGRAM = "histogram"  # quantiles and top-fraction means read from summed fine histograms
    LOCAL = "local"  # not reduced: the process's own timings, the serving rank's edit distance


class Source(StrEnum):
    """Who computes a metric: the per-step tensor math, or the stateful monitor around it."""

    STEP = "step"
    MONITOR = "monitor"


ONE_PER_RUN = "config (one value per run)"  # a Label bound: one value for the whole run


@dataclass(frozen=True)
class Label:
    """A label and its bounded value set.

    ``values`` lists the allowed values; when it is empty the values come from configuration and ``bound``
    names the config knob that bounds them.
    """

    name: str
    values: tuple[str, ...] = ()
    bound: str = ""


@dataclass(frozen=True)
class Metric:
    """One metric family."""

    name: str
    type: MetricType
    help: str
    layer: Layer
    unit: str = ""
    labels: tuple[Label, ...] = ()
    inputs: tuple[str, ...] = ()
    source: Source = Source.STEP
    quantiles: tuple[float, ...] = ()
    buckets: tuple[float, ...] = ()
    merge: Merge | None = None

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.name for label in self.labels)

    def merge_of(self, sample: str) -> Merge:
        """How the sample ``sample`` (this family's name plus a suffix) merges across ranks."""
        if self.source is Source.MONITOR:
            return Merge.LOCAL
        if self.type in (MetricType.COUNTER, MetricType.HISTOGRAM) or sample != self.name:
            return Merge.SUM
        if self.type is MetricType.SUMMARY:
            return Merge.HISTOGRAM
        assert self.merge is not None  # validate() requires it of every step gauge
        return self.merge

    def __hash__(self) -> int:
        """The name's hash (cached by the string; equal entries have equal names): a catalogue entry is a key of
        the sample-key cache, asked a few hundred times a step, where hashing every field would be paid each
        time."""
        return hash(self.name)

    def key(self, suffix: str = "", **labels: str) -> SampleKey:
        """The sample key of ``name+suffix`` with ``labels``, used in step mappings, the publication and tests.

        Labels are kept in catalogue order; a label this family does not declare, a value outside a fixed
        value set, or a value that is not a valid label value (:func:`check_label_value`) raises ``ValueError``.
        Keys are built once each and cached (the step asks for the same few hundred keys every step).
        """
        return _sample_key(self, suffix, tuple(labels.items()))

    def _build_key(self, suffix: str, items: tuple[tuple[str, str], ...]) -> SampleKey:
        labels = dict(items)
        declared = {label.name: label for label in self.labels}
        extra = set(labels) - set(declared) - {"quantile", "le"}
        if extra:
            raise ValueError(f"metric {self.name!r} has no label(s) {sorted(extra)}; declared: {sorted(declared)}")
        for name, value in labels.items():
            label = declared.get(name)
            if label is not None and label.values and value not in label.values:
                raise ValueError(
                    f"metric {self.name!r} label {name!r}: expected one of {label.values}, got {value!r}"
                )
            check_label_value(name, value)
        ordered = tuple((n, labels[n]) for n in (*self.label_names, "quantile", "le") if n in labels)
        return SampleKey(self.name + suffix, ordered)


@functools.lru_cache(maxsize=16384)
def _sample_key(family: Metric, suffix: str, items: tuple[tuple[str, str], ...]) -> SampleKey:
    return family._build_key(suffix, items)


MAX_LABEL_VALUE_LENGTH = 128


def check_label_value(name: str, value: object) -> str:
    """``value`` if it may be a label value: a string of at most 128 characters without control characters
    (quotes, braces and backslashes are fine: they are escaped when written; empty means "no such label"
    to Prometheus). ``ValueError`` naming the label otherwise; user-supplied values (run, reward component
    names) are checked with this at the boundary."""
    if not isinstance(value, str):
        raise ValueError(f"label {name!r}: expected a string, got {type(value).__name__} {value!r:.80}")
    if len(value) > MAX_LABEL_VALUE_LENGTH:
        raise ValueError(
            f"label {name!r}: expected at most {MAX_LABEL_VALUE_LENGTH} characters, got {len(value)}: {value!r:.80}"
        )
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"label {name!r}: expected no control characters, got {bad!r} in {value!r:.80}")
    return value


def is_label_value(value: object) -> bool:
    """Whether :func:`check_label_value` accepts ``value``."""
    try:
        check_label_value("", value)
    except ValueError:
        return False
    return True


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class SampleKey(str):
    """A sample's identity kept structured: ``sample`` (family name plus suffix) and ``labels`` (name, value)
    pairs. It *is* its exposition-style string ``name{label="escaped value",...}`` (so mappings keyed by it
    can be read with a plain string), but nothing parses that string back: the collector, the publication
    and the guard read ``sample`` and ``labels``. Escaping makes the string form unambiguous, whatever the
    values hold."""

    sample: str
    labels: tuple[tuple[str, str], ...]

    def __new__(cls, sample: str, labels: tuple[tuple[str, str], ...] = ()) -> SampleKey:
        body = ",".join(f'{n}="{_escape(v)}"' for n, v in labels)
        self = super().__new__(cls, f"{sample}{{{body}}}" if body else sample)
        self.sample, self.labels = sample, tuple(labels)
        return self

    def __reduce__(self) -> tuple[type[SampleKey], tuple[str, tuple[tuple[str, str], ...]]]:
        """Pickled (and copied) as its sample and labels: not the cached :attr:`family`, a catalogue entry."""
        return SampleKey, (self.sample, self.labels)

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    @functools.cached_property
    def family(self) -> Metric:
        """The catalogue family this sample belongs to (:func:`family_of`), looked up once per key: the
        publication asks it of every sample of every step."""
        return family_of(self.sample)

    @functools.cached_property
    def additive(self) -> bool:
        """Whether this sample accumulates across steps (:func:`is_additive`), looked up once per key."""
        return _is_additive_sample(self.sample)


def format_quantile(q: float) -> str:
    """Prometheus label value of a quantile: ``0.5``, ``0.999``, ``1``."""
    return repr(float(q)).removesuffix(".0")


GAP_QUANTILES = (0.5, 0.99, 0.999, 1.0)
RATIO_QUANTILES = (0.0, 0.5, 0.95, 0.99, 1.0)
LENGTH_QUANTILES = (0.99,)
TURN_QUANTILES = (0.0, 1.0)
SOLVE_RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Classic buckets of the per-token / per-completion histograms: edges of the exporter's fine histogram (floats
# with at most 7 mantissa bits, :mod:`grpo_exporter.functional.histogram`), so each count is exact.
GAP_BUCKETS = tuple(2.0**e for e in range(-20, 2))  # 9.5e-7 .. 2 nats, one per octave (0.001 ~ 2^-10)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 1.0, 1.0078125, 1.015625, 1.03125,
                 1.0625, 1.125, 1.25, 1.5, 2.0, 4.0)  # dense around 1: +-1/128 .. +-1/2
ENTROPY_BUCKETS = (2.0**-7, 2.0**-5, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
LENGTH_BUCKETS = tuple(2.0**e for e in range(5, 16))  # 32 .. 32768 tokens, one per octave
OBSERVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

NONFINITE_TENSORS = (
    "logprobs",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
    "entropy",
    "advantages",
    "rewards",
    "reward_components",
    "log_ratio",
    "ratio",
    "loss",
    "grad_norm",
)
ADVANTAGE_SIGNS = ("positive", "negative", "zero")
#: the advantage forms an estimator produces (the ``advantage_norm`` setting's values, config.AdvantageNorm)
ADVANTAGE_FORMS = ("unbiased", "population", "none", "batch", "whitened", "shaped")
PREFLIGHT_CHECKS = ("abc_consistency", "accumulation_equivalence", "nll_reach", "mask_table")
CLIP_BOUNDS = ("upper", "lower")
OUTCOMES = ("correct", "incorrect", "all")
ZERO_VARIANCE_OUTCOMES = ("all_correct", "all_incorrect", "unknown")
FILTERED_OUTCOMES = ("all_correct", "all_incorrect")
ESS_LEVELS = ("token", "sequence")
ROUTING_SPLIT = ("agrees", "differs")  # the tokens whose MoE routing agrees with the engine's in every layer, or not
ROUTING_SIDES = ("trainer", "engine")
TURNS = ("1", "2", "3", "4", "5+")  # the model turns of a multi-turn completion; the last gathers the later ones
STAGES = ("rollout", "update", "grad", "guard", "publish", "scrape", "distributed")
# threads of their own: the flight recorder, the reading set, the target file
ERROR_STAGES = (*STAGES, "recorder", "reading", "targets")
#: why a stage call of a monitor with compile_step="auto" took the eager step (grpo_exporter.runtime.compilation)
COMPILE_FALLBACKS = ("compiler", "run", "recompile", "late", "busy", "pending")

_COMPONENT = Label("component", bound="max_reward_components (names from reward_components, plus 'total')")
_K = Label("k", bound="pass_k (plus 1 and group_size)")

G, R, S, D, L = Layer.GRADIENT, Layer.REWARD, Layer.SAMPLES, Layer.DIVERSITY, Layer.LIVENESS
C, GA, SU, H = MetricType.COUNTER, MetricType.GAUGE, MetricType.SUMMARY, MetricType.HISTOGRAM
_TOKEN = ("loss_mask",)
_ROUTING = ("routed_experts", "rollout_routed_experts", *_TOKEN)

CATALOG: tuple[Metric, ...] = (
    # ---- layer 1: does the gradient match what I think? ------------------------------------------------
    Metric(
        "grpo_engine_logprob_gap_nats", SU,
        "Per-token |rollout_logprobs - old_logprobs| on loss tokens: the rollout engine and the trainer "
        "disagreeing on the same token under the same weights, in nats. Quantiles describe the last step; "
        "_sum/_count are cumulative. Mean < 0.001 healthy, mean >= 0.01 stop training; the 0.01 line "
        "applies to the mean, never to the max.",
        G, "nats", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), quantiles=GAP_QUANTILES,
    ),
    Metric(
        "grpo_token_engine_logprob_gap_nats", H,
        "Per-token engine log-prob gap |rollout_logprobs - old_logprobs| on loss tokens as a histogram, nats, "
        "cumulative: histogram_quantile over ranks, runs and windows (buckets one per octave, 2^-20 to 2).",
        G, "nats", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), buckets=GAP_BUCKETS,
    ),
    Metric(
        "grpo_engine_logprob_gap_mean_nats", GA,
        "Mean engine log-prob gap |rollout_logprobs - old_logprobs| over the last step's loss tokens, nats.",
        G, "nats", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_engine_logprob_gap_turn_mean_nats", GA,
        "Mean engine log-prob gap |rollout_logprobs - old_logprobs| over the last step's loss tokens of each model "
        "turn of multi-turn completions (turns told apart by tool_mask's spans; 5+ gathers the later ones), nats. "
        "A gap that grows with the turn is a boundary the engine and the trainer tokenize differently (verl PR "
        "#6921: a separator dropped at each tool boundary); verl PR #5229 logs the mismatch per round alike.",
        G, "nats", labels=(Label("turn", TURNS),), inputs=("rollout_logprobs", "old_logprobs", "tool_mask", *_TOKEN),
        merge=Merge.RATIO,
    ),
    Metric(
        "grpo_engine_logprob_gap_clean_baseline_nats", GA,
        "The run's own clean engine gap: the mean of the per-rollout mean gaps of its first gap_baseline_steps "
        "(20) rollouts, frozen, in nats; absent before. A gap many times it is another probability path even far "
        "below 0.001 (measure your own clean baseline first).",
        G, "nats", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), source=Source.MONITOR,
    ),
    Metric(
        "grpo_engine_logprob_gap_accepted_nats", GA,
        "The engine gap level the run is judged against, nats: reference_baseline's "
        "grpo_engine_logprob_gap_mean_nats when configured (the setup's accepted level, confirmed once by the "
        "A/B/C preflight), else the run's own clean gap; absent before either exists. GRPOEngineLogprobGapWarning "
        "and the jump test of GRPOEngineLogprobGapCritical compare the gap with multiples of it.",
        G, "nats", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), source=Source.MONITOR,
    ),
    Metric(
        "grpo_mismatch_kl_nats", GA,
        "KL(engine || trainer) on the last rollout's finite loss tokens, nats, by two estimators: k1 = the mean "
        "signed gap rollout_logprobs - old_logprobs (verl rollout_corr/kl, TRL's signed sampling_logp_difference), "
        "k3 = mean exp(l) - 1 - l with l = old - rollout (prime-rl mismatch_kl, verl rollout_corr/k3_kl). "
        "Numeric noise enters k1 only to second order (~sd^2/2: ~1e-3 on healthy bf16 stacks, NeMo-RL), a "
        "systematic difference (top-p renormalised log-probs, a temperature, stale weights) to first order; "
        "k3 < k1 when the correction weights do not average 1 (a renormalised engine distribution).",
        G, "nats", labels=(Label("estimator", ("k1", "k3")),), inputs=("rollout_logprobs", "old_logprobs", *_TOKEN),
        merge=Merge.RATIO,
    ),
    Metric(
        "grpo_mismatch_chi_square", GA,
        "Chi-square divergence of the rollout-correction weights w = pi_old / pi_rollout on the last rollout: "
        "token: mean w^2 - 1 over finite loss tokens; sequence: mean (prod_t w)^2 - 1 over sequences (verl "
        "rollout_corr/chi2_token, chi2_seq; > 1 is a severe shift by verl's rule of thumb). log w clamped to +-20.",
        G, labels=(Label("level", ESS_LEVELS),), inputs=("rollout_logprobs", "old_logprobs", *_TOKEN),
        merge=Merge.RATIO,
    ),
    Metric(
        "grpo_mismatch_log_ppl_diff_nats", GA,
        "Mean over the last rollout's sequences of mean_t(rollout_logprobs) - mean_t(old_logprobs) on loss "
        "tokens, nats: log(training perplexity / rollout perplexity) per sequence (verl rollout_corr/log_ppl_diff).",
        G, "nats", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_mismatch_ppl_multiple", GA,
        "Mean over the last rollout's sequences of training perplexity / rollout perplexity, exp of each "
        "sequence's log_ppl_diff (verl rollout_corr/ppl_ratio); 1 when trainer and engine agree.",
        G, inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_rollout_correction_weight", SU,
        "Per-token rollout-correction weight w = exp(old_logprobs - rollout_logprobs) on finite loss tokens, before "
        "any truncation (TRL logs its ratio only after; TRL #5231): quantiles of the last rollout; _sum/_count "
        "cumulative (the mean is E[w] = 1 for two full distributions, the kept mass under top-p: 0.895 at top_p "
        "0.8, TRL #6789).",
        G, inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), quantiles=RATIO_QUANTILES,
    ),
    Metric(
        "grpo_token_rollout_correction_weight", H,
        "Per-token rollout-correction weight pi_old / pi_rollout before truncation, as a histogram, cumulative "
        "(buckets dense around 1).",
        G, inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), buckets=RATIO_BUCKETS,
    ),
    Metric(
        "grpo_sequence_rollout_correction_weight", H,
        "Per-sequence geometric rollout-correction weight exp(mean_t(old - rollout)) before truncation (the "
        "weight of geometric sequence-level TIS/MIS), as a histogram, cumulative.",
        G, inputs=("rollout_logprobs", "old_logprobs", *_TOKEN), buckets=RATIO_BUCKETS,
    ),
    Metric(
        "grpo_rollout_correction_capped_tokens_total", C,
        "Loss tokens whose rollout-correction weight exceeds rollout_correction_cap: the tokens token-level TIS "
        "truncates or MIS masks (TRL cap 3, verl 2, slime 2, AReaL 5); only when the cap is configured.",
        G, "tokens", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN),
    ),
    Metric(
        "grpo_rollout_correction_capped_sequences_total", C,
        "Sequences whose geometric rollout-correction weight exceeds rollout_correction_cap (geometric sequence "
        "TIS/MIS); only when the cap is configured.",
        G, "sequences", inputs=("rollout_logprobs", "old_logprobs", *_TOKEN),
    ),
    Metric(
        "grpo_rollout_correction_capped_ratio", GA,
        "Share of the last rollout's loss tokens (level=token) or sequences (level=sequence) above "
        "rollout_correction_cap.",
        G, "ratio", labels=(Label("level", ESS_LEVELS),), inputs=("rollout_logprobs", "old_logprobs", *_TOKEN),
        merge=Merge.RATIO,
    ),
    Metric(
        "grpo_routing_compared_decisions_total", C,
        "Mixture-of-experts routing decisions compared between trainer and engine: (loss token, MoE layer) pairs "
        "where both sides recorded the token's k experts, cumulative.",
        G, "decisions", inputs=_ROUTING,
    ),
    Metric(
        "grpo_routing_differing_decisions_total", C,
        "Compared routing decisions where the trainer's set of k experts differs from the engine's (the order "
        "within the k does not matter), cumulative. With routing replay on, any is a replay that fell back.",
        G, "decisions", inputs=_ROUTING,
    ),
    Metric(
        "grpo_routing_unrecorded_decisions_total", C,
        "Routing decisions on loss tokens that the trainer made and the engine recorded no route for (a negative "
        "id: a route the engine did not return), cumulative. With routing replay on, the trainer routed them "
        "itself: a replay that fell back (NeMo-RL's r3/routed_experts_fallback_token_route_fraction).",
        G, "decisions", inputs=_ROUTING,
    ),
    Metric(
        "grpo_routing_mismatch_ratio", GA,
        "Share of the last rollout's loss tokens whose set of experts differs between trainer and engine, per MoE "
        "layer (moe_layer 0..L-1, the layer's index among the MoE layers). A router is a second probability "
        "path: ~10% of decisions differ on Qwen3-30B-A3B with a bf16 engine (arXiv 2510.11370); a layer that "
        "rises alone against its own early level is that layer's router out of sync; the worst layer is max by "
        "(run).",
        G, "ratio", labels=(Label("moe_layer", bound="max_moe_layers"),), inputs=_ROUTING, merge=Merge.RATIO,
    ),
    Metric(
        "grpo_routing_decision_mismatch_ratio", GA,
        "Share of the last rollout's compared (loss token, MoE layer) decisions whose experts differ between "
        "trainer and engine: the routing mismatch of the whole model. Never 0 for an MoE engine in bf16 or FP8 "
        "without replay; its rise against the run's own early level is the fault (a weight sync that skips the "
        "router), its level alone is not.",
        G, "ratio", inputs=_ROUTING, merge=Merge.RATIO,
    ),
    Metric(
        "grpo_routing_mismatch_tokens_ratio", GA,
        "Share of the last rollout's loss tokens routed differently in at least one MoE layer (94% on "
        "Qwen3-30B-A3B, arXiv 2510.11370: near 1 for deep models, so the per-decision share is what moves).",
        G, "ratio", inputs=_ROUTING, merge=Merge.RATIO,
    ),
    Metric(
        "grpo_routing_replay_enabled", GA,
        "1 while the trainer replays the engine's routing (routing replay, R3: routing_replay=True), 0 when it "
        "routes itself; absent when not said. With it on, a differing decision is a replay that fell back.",
        G, inputs=("routing_replay",), merge=Merge.SAME,
    ),
    Metric(
        "grpo_engine_logprob_gap_by_routing_mean_nats", GA,
        "Mean engine log-prob gap |rollout_logprobs - old_logprobs| over the last rollout's loss tokens whose "
        "routing agrees with the engine's in every MoE layer (routing=agrees) or differs in one or more "
        "(routing=differs), nats: a gap that lives on the differing tokens is the router's.",
        G, "nats", labels=(Label("routing", ROUTING_SPLIT),), inputs=(*_ROUTING, "rollout_logprobs", "old_logprobs"),
        merge=Merge.RATIO,
    ),
    Metric(
        "grpo_engine_logprob_gap_routing_share_ratio", GA,
        "Share of the last rollout's summed engine gap |rollout_logprobs - old_logprobs| carried by loss tokens "
        "whose routing differs in at least one MoE layer: how much of the gap routing explains.",
        G, "ratio", inputs=(*_ROUTING, "rollout_logprobs", "old_logprobs"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_expert_load_peak_multiple", GA,
        "The most-loaded expert's share of one side's routed slots on the last rollout's loss tokens, as a "
        "multiple of an even split (1 = even; moe_experts / k = one expert in every token's k), in the MoE layer "
        "where it is largest; side=trainer or engine. A router that collapses onto a few experts shows here. On few "
        "tokens an even router reads above 1 (a maximum of sampled shares); across ranks the largest rank's. Only "
        "with moe_experts set.",
        G, labels=(Label("side", ROUTING_SIDES),), inputs=("routed_experts", "rollout_routed_experts", *_TOKEN),
        merge=Merge.MAX,
    ),
    Metric(
        "grpo_onpolicy_outside_clip_tokens_total", C,
        "Loss tokens whose importance ratio is already outside [1-eps_low, 1+eps_high] on the first update "
        "of a fresh rollout batch, before any weight changed ('clip before any update' = stop).",
        G, "tokens", inputs=("logprobs", "old_logprobs", "on_policy", *_TOKEN),
    ),
    Metric(
        "grpo_onpolicy_checked_tokens_total", C,
        "Loss tokens examined by the on-policy ratio check (first update of each rollout batch).",
        G, "tokens", inputs=("logprobs", "old_logprobs", "on_policy", *_TOKEN),
    ),
    Metric(
        "grpo_onpolicy_outside_clip_ratio", GA,
        "Share of loss tokens outside the clip range on the last on-policy update; should be ~0.",
        G, "ratio", inputs=("logprobs", "old_logprobs", "on_policy", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_onpolicy_log_ratio_abs_max_nats", GA,
        "Max |logprobs - old_logprobs| over loss tokens on the last on-policy update, nats; ~0 when trainer "
        "and behaviour policy compute the same probabilities.",
        G, "nats", inputs=("logprobs", "old_logprobs", "on_policy", *_TOKEN), merge=Merge.MAX,
    ),
    Metric(
        "grpo_onpolicy_log_ratio_clean_baseline_nats", GA,
        "The run's own recomputation noise: the mean of grpo_onpolicy_log_ratio_abs_max_nats over its first "
        "anchor_steps (20) on-policy updates, frozen, in nats; absent before. An on-policy max |log r| many "
        "times it is another probability path even inside the clip band (the first update's ratio is 1).",
        G, "nats", inputs=("logprobs", "old_logprobs", "on_policy", *_TOKEN), source=Source.MONITOR,
    ),
    Metric(
        "grpo_nonfinite_values_total", C,
        "Non-finite (NaN or +-Inf) values seen, per tensor; token tensors are checked on loss tokens only, "
        "so a -inf padding sentinel is not counted; a tensor handed to two observe calls is checked in both. "
        "log_ratio is computed in fp32 without clamp, ratio as exp of the log ratio after log_ratio_clamp when "
        "one is configured; reward_components counts every component's values.",
        G, "values", labels=(Label("tensor", NONFINITE_TENSORS),), inputs=(),
    ),
    Metric(
        "grpo_rollout_unscored_tokens_total", C,
        "Loss tokens the rollout engine handed back without a log-prob (NaN rollout_logprobs under "
        "rollout_logprob_nan=unscored: vLLM's None, as TRL hands it); they are left out of the engine gap and "
        "the mismatch readings, as TRL leaves them out of sampling/sampling_logp_difference. Only in that mode.",
        G, "tokens", inputs=("rollout_logprobs", *_TOKEN),
    ),
    Metric(
        "grpo_loss_mask_length_mismatch_sequences_total", C,
        "Sequences with loss tokens whose loss-token count differs from completion_lengths (assert "
        "loss_mask.sum() == completion tokens).",
        G, "sequences", inputs=("completion_lengths", *_TOKEN),
    ),
    Metric(
        "grpo_loss_mask_empty_sequences_total", C,
        "Completions with tokens but no loss tokens (masked whole, e.g. overlong filtering): a reason count, "
        "not an error.",
        G, "sequences", inputs=("completion_lengths", *_TOKEN),
    ),
    Metric(
        "grpo_loss_mask_outside_completion_tokens_total", C,
        "Loss tokens on positions that are not completion tokens (prompt, tool output, padding): a mask bug.",
        G, "tokens", inputs=("completion_lengths", *_TOKEN),
    ),
    Metric(
        "grpo_loss_mask_tool_tokens_total", C,
        "Loss tokens on positions the environment wrote (tool_mask: tool responses, observations inside a "
        "multi-turn completion): the loss trains the model on text it never sampled (verl #4412, slime #1370). "
        "Every other reading leaves tool positions out, whatever the loss covers.",
        G, "tokens", inputs=("tool_mask", *_TOKEN),
    ),
    Metric(
        "grpo_log_ratio_clamp_hit_tokens_total", C,
        "Loss tokens whose |log ratio| reached the numerical log-ratio clamp (the fuse before exp). Should be "
        "~0; frequent hits mean look at probability consistency or staleness, not at the clamp.",
        G, "tokens", inputs=("logprobs", "old_logprobs", "log_ratio_clamp", *_TOKEN),
    ),
    Metric(
        "grpo_log_ratio_clamp_hit_ratio", GA,
        "Share of the last step's loss tokens whose |log ratio| reached the numerical clamp.",
        G, "ratio", inputs=("logprobs", "old_logprobs", "log_ratio_clamp", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_grad_norm_pre_clip", GA,
        "Global gradient L2 norm before clipping (log before clipping: this is where spikes are visible).",
        G, inputs=("grad_norm_pre_clip|grads",), merge=Merge.SAME,
    ),
    Metric(
        "grpo_grad_norm_spike_steps_total", C,
        "Optimizer steps whose pre-clip grad norm (per share of signal-carrying tokens) exceeded grad_spike_factor "
        "(10) times the median of the previous grad_spike_window_steps non-zero norms and grad_spike_tail_factor "
        "(3) times their 90th percentile: sudden for the run, recorded, not paged alone. Counted in "
        "the process: a one-step spike is never missed between scrapes.",
        G, "steps", inputs=("grad_norm_pre_clip",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_grad_norm_spike_confirmed_steps_total", C,
        "Grad-norm spikes confirmed by what a real instability moves with them, at the spike or within "
        "grad_spike_confirm_steps (2) training steps: a non-finite value, the log-ratio fuse hit, the token ESS "
        "ratio below half its window minimum, |dtheta|/|theta| 3x its window maximum, a spike on another "
        "rollout; or a spike "
        "beyond grad_spike_extreme_factor (100) times the median. GRPOGradNormSpike pages on it (the field "
        "notes: ESS warns, the grad norm confirms).",
        G, "steps", inputs=("grad_norm_pre_clip",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_grad_norm_post_clip", GA,
        "Global gradient L2 norm after clipping.",
        G, inputs=("grad_norm_pre_clip|grads", "grad_norm_post_clip|max_grad_norm"), merge=Merge.SAME,
    ),
    Metric(
        "grpo_optimizer_steps_total", C,
        "Optimizer steps whose gradient norm was recorded.",
        G, "steps", inputs=("grad_norm_pre_clip|grads",),
    ),
    Metric(
        "grpo_grad_clip_active_steps_total", C,
        "Optimizer steps where the pre-clip norm exceeded max_grad_norm, i.e. clipping rescaled the update. "
        "Active on nearly every step means the root cause is unsolved.",
        G, "steps", inputs=("grad_norm_pre_clip|grads", "max_grad_norm"),
    ),
    Metric(
        "grpo_param_relative_update", GA,
        "Relative parameter update |theta_after - theta_before| / |theta_before| over the sampled parameters "
        "of the last optimizer step (dimensionless).",
        G, inputs=("params_before", "params_after"), merge=Merge.SAME,
    ),
    Metric(
        "grpo_param_update_jump_steps_total", C,
        "Optimizer steps whose relative parameter update |dtheta|/|theta| exceeded grad_spike_update_factor (3) "
        "times its largest over the previous grad_spike_window_steps steps: a violent update whatever the grad "
        "norm did (a learning rate multiplied, the optimizer state, the loss scale). Counted in the process, from "
        "the parameters clip_grad_norm_ samples; GRPOParamUpdateJump pages on it.",
        G, "steps", inputs=("params_before", "params_after"), source=Source.MONITOR,
    ),
    Metric(
        "grpo_rollout_staleness_versions", GA,
        "Policy versions between the trainer and the policy that generated the rollouts being trained on "
        "(off-policyness: a samples question, layer 3, like its alert GRPORolloutsStale).",
        S, "versions", inputs=("policy_version", "rollout_policy_version"), merge=Merge.SAME,
    ),
    Metric(
        "grpo_token_staleness_mean_versions", GA,
        "Policy versions between the weights this update trains and the weights that generated each "
        "completion's oldest token, averaged over the update's loss tokens (verl fully-async's "
        "fully_async/trajectory_staleness/mean: a partial or multi-turn trajectory is as old as its oldest "
        "part, and a long one weighs its tokens). Beside grpo_rollout_staleness_versions (one number per batch).",
        S, "versions", inputs=("staleness", "loss_mask"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_token_staleness_max_versions", GA,
        "Largest staleness of the update's completions with a loss token (fully_async/trajectory_staleness/max).",
        S, "versions", inputs=("staleness", "loss_mask"), merge=Merge.MAX,
    ),
    Metric(
        "grpo_aborted_completions_total", C,
        "Completions the rollout aborted (cut by a weight sync or a deadline, no response token; verl's "
        "response/aborted_ratio counts them in the batch) and handed to no loss. Over grpo_completions_total plus "
        "itself: the share of generation aborted.",
        S, "completions", inputs=("aborted_completions",),
    ),
    Metric(
        "grpo_stale_update_steps_total", C,
        "Update steps whose rollouts were more than staleness_max_versions (4) policy versions old, counted in "
        "the process on every step: the staleness gauge resets at every weight sync, so scrapes alone can miss "
        "every peak.",
        S, "steps", inputs=("policy_version", "rollout_policy_version"), source=Source.MONITOR,
    ),
    Metric(
        "grpo_dropped_stale_completions_total", C,
        "Completions an asynchronous loop generated and then dropped as too stale to train on (verl fully-async's "
        "fully_async/count/dropped_stale_samples), counted from the loop's own running total: generation that "
        "never reached the gradient. Over grpo_completions_total: the share of generation wasted to staleness.",
        S, "completions", inputs=("dropped_stale_total",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_kl_ref_nats", GA,
        "Mean per-token KL(pi_theta || pi_ref) over loss tokens with the k3 estimator "
        "exp(ref - logp) - (ref - logp) - 1 (unbiased, non-negative), nats.",
        G, "nats", inputs=("logprobs", "ref_logprobs", *_TOKEN), merge=Merge.RATIO,
    ),
    # ---- layer 2: does the reward measure what I think? -------------------------------------------------
    Metric(
        "grpo_completions_total", C,
        "Completions observed (N = prompts x group size per rollout batch).",
        R, "completions", inputs=("rewards",),
    ),
    Metric(
        "grpo_reward_mean", GA,
        "Mean reward of the last rollout batch, per reward component and for the total (component='total').",
        R, labels=(_COMPONENT,), inputs=("rewards|reward_components",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_reward_group_std_mean", GA,
        "Mean over groups of the within-group reward standard deviation (population), before any "
        "normalisation: a tiny value scaled up by sigma-normalisation is noise made loud.",
        R, labels=(_COMPONENT,), inputs=("rewards|reward_components",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_reward_group_range_mean", GA,
        "Mean over groups of the within-group reward range (max - min), before any normalisation.",
        R, labels=(_COMPONENT,), inputs=("rewards|reward_components",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_noise_advantage_groups_ratio", GA,
        "Share of the last rollout batch's groups whose advantage is reward noise made loud: "
        "the group's reward range is above 0 but below noise_range_fraction (0.01) of the reward's scale "
        "(reward_scale, else the batch's own reward range) and the advantage divides by the group's sigma, which "
        "scales any spread to full size. 0 without sigma-normalisation (advantage_norm none or batch), where a "
        "tiny spread stays a tiny advantage.",
        R, "ratio", inputs=("rewards", "advantage_norm"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_reward_tied_variance_ratio", GA,
        "Over the groups whose completions are all correct or all incorrect yet whose reward varies: each "
        "component's share of the components' summed within-group variance (as handed: TRL's are unweighted), "
        "before normalisation. The component that supplies the advantage the verifier cannot (a format or "
        "length term, or its noise).",
        R, "ratio", labels=(Label("component", bound="max_reward_components (names from reward_components)"),),
        inputs=("rewards", "correct", "reward_components"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_advantage_abs_max", GA,
        "Max |advantage| over the last batch's sequences (over loss tokens for per-token advantages).",
        R, inputs=("advantages",), merge=Merge.MAX,
    ),
    Metric(
        "grpo_advantage_bound", GA,
        "Largest |advantage| the form of the step's advantages can produce: (G-1)/sqrt(G) for a group z-score "
        "with unbiased std (G=16: 3.75, G=8: 2.47), sqrt(G-1) with population std, (G-1)/G x group reward range "
        "for group-centred rewards. The form is the one the data follows (grpo_advantage_form_sequences_total), "
        "else the configured advantage_norm; absent for a form without a group bound (batch, whitened, shaped). "
        "Above it is a data or reward bug, not dynamics.",
        R, inputs=("group_size", "advantage_norm"), merge=Merge.MAX,
    ),
    Metric(
        "grpo_advantage_over_bound_sequences_total", C,
        "Sequences whose |advantage| exceeds the bound of their group (grpo_advantage_bound).",
        R, "sequences", inputs=("advantages",),
    ),
    Metric(
        "grpo_advantage_form_sequences_total", C,
        "Sequences of complete groups (G members, finite advantages) whose advantages were sorted into a form, by "
        "the form the step's advantages follow: unbiased or population (group z-score), none (group-centred), "
        "batch (group-centred over one batch-wide scale), whitened (batch-whitened), shaped (varying along the "
        "sequence: a reward shaped per token), unknown (none of these: the configured form's bound judges them). "
        "A known form other than the configured advantage_norm: GRPOAdvantageFormUnexpected.",
        R, "sequences", labels=(Label("form", (*ADVANTAGE_FORMS, "unknown")),), inputs=("advantages",),
    ),
    Metric(
        "grpo_advantage_inconsistent_sequences_total", C,
        "Sequences of complete groups whose advantage contradicts their group: with the same sequences' rewards "
        "passed to observe_update, an advantage that ranks the completion against its reward within the group or "
        "moves where the group's rewards tie; under a group-centred advantage_norm (unbiased, population, none, "
        "batch), a member of a group whose advantages do not sum to 0 while no known form fits (the groups "
        "handed over are not the estimator's). Not counted under whitened or shaped.",
        R, "sequences", inputs=("advantages", "group_ids", "rewards"),
    ),
    Metric(
        "grpo_completion_length_tokens", SU,
        "Completion length in tokens by outcome (correct / incorrect / all); p99 of the last step, "
        "_sum/_count cumulative. Length growing only on incorrect = 1/|o| loss aggregation; growing faster "
        "on correct = length hack.",
        R, "tokens", labels=(Label("outcome", OUTCOMES),), inputs=("completion_lengths",),
        quantiles=LENGTH_QUANTILES,
    ),
    Metric(
        "grpo_completion_length_distribution_tokens", H,
        "Completion length in tokens by outcome as a histogram, cumulative: length distributions across ranks "
        "and windows (buckets one per octave, 32 to 32768).",
        R, "tokens", labels=(Label("outcome", OUTCOMES),), inputs=("completion_lengths",), buckets=LENGTH_BUCKETS,
    ),
    Metric(
        "grpo_truncated_completions_total", C,
        "Completions that hit the maximum length (sample level; kept apart from token-level clip fractions).",
        R, "completions", inputs=("truncated",),
    ),
    Metric(
        "grpo_completion_length_tool_span_sequences_total", C,
        "Completions whose length counts their tool tokens (the span from first to last model token, not the "
        "model's tokens: length = model loss tokens + tool tokens; OpenRLHF PR #1252): length penalties and "
        "overlong filters judge the wrong length. Not counted as a loss-mask length mismatch.",
        R, "sequences", inputs=("tool_mask", "completion_lengths", *_TOKEN),
    ),
    Metric(
        "grpo_completion_turns", SU,
        "Model turns per completion of a multi-turn (agent, tool-calling) rollout: quantiles 0 (min) and 1 (max) "
        "of the last rollout, _sum/_count cumulative (the mean is rate(_sum) / rate(_count)); verl's "
        "num_turns/min, max and mean.",
        R, "turns", inputs=("turns",), quantiles=TURN_QUANTILES,
    ),
    Metric(
        "grpo_tool_calls_total", C,
        "Tool calls the rollouts' completions made, run or failed. Per completion: over grpo_completions_total "
        "(TRL's tools/call_frequency, verl's tool_call_counts/mean).",
        R, "calls", inputs=("tool_calls",),
    ),
    Metric(
        "grpo_tool_call_failures_total", C,
        "Tool calls that failed (the tool raised, was unknown, or the call was malformed). Over "
        "grpo_tool_calls_total: TRL's tools/failure_frequency. Failing tools turn into reward the model cannot earn.",
        R, "failures", inputs=("tool_failures",),
    ),
    Metric(
        "grpo_partial_completions_total", C,
        "Completions generated over more than one policy version (a partial rollout resumed on newer weights; "
        "verl fully-async's max_global_steps > min_global_steps). Over grpo_completions_total: verl's "
        "fully_async/partial/partial_ratio.",
        R, "completions", inputs=("partial",),
    ),
    # ---- layer 3: how many samples decide this update? --------------------------------------------------
    Metric(
        "grpo_ess_ratio", GA,
        "Effective sample size ratio (sum w)^2 / (sum w^2) / n of the importance weights of the last update, "
        "per token and per sequence (w = exp of the summed log ratio). Falls before grad norm spikes.",
        S, "ratio", labels=(Label("level", ESS_LEVELS),), inputs=("logprobs", "old_logprobs", *_TOKEN),
        merge=Merge.ESS,
    ),
    Metric(
        "grpo_update_tokens_total", C,
        "Loss tokens entering the policy loss, by advantage sign: the denominators of the clip fractions.",
        S, "tokens", labels=(Label("advantage_sign", ADVANTAGE_SIGNS),), inputs=("advantages", *_TOKEN),
    ),
    Metric(
        "grpo_clipped_tokens_total", C,
        "Loss tokens whose gradient the PPO clip truly cuts: upper = A>0 and r>1+eps_high, lower = A<0 and "
        "r<1-eps_low. Divide upper by positive-advantage tokens and lower by negative ones; never merge them.",
        S, "tokens", labels=(Label("bound", CLIP_BOUNDS),),
        inputs=("logprobs", "old_logprobs", "advantages", *_TOKEN),
    ),
    Metric(
        "grpo_upper_clip_reachable_tokens_total", C,
        "Positive-advantage loss tokens whose old probability leaves room for the upper clip: p_old < "
        "1/(1+eps_high) (a token at p_old ~1 can never reach r > 1+eps_high, as in a solved task). The "
        "population GRPOLowerClipDominant needs before it reads a missing upper clip as asymmetry.",
        S, "tokens", inputs=("old_logprobs", "advantages", *_TOKEN),
    ),
    Metric(
        "grpo_clipped_tokens_ratio", GA,
        "Per-step truly-clipped fraction by bound, normalised by the tokens of the gating advantage sign. "
        "Lower dominant while upper ~0 is a collapse precursor.",
        S, "ratio", labels=(Label("bound", CLIP_BOUNDS),),
        inputs=("logprobs", "old_logprobs", "advantages", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_out_of_range_unclipped_tokens_total", C,
        "Loss tokens outside the clip range on the side opposite to their advantage sign (A<0 and "
        "r>1+eps_high, A>0 and r<1-eps_low): the min() keeps the unclipped term, gradient still flows.",
        S, "tokens", labels=(Label("bound", CLIP_BOUNDS),),
        inputs=("logprobs", "old_logprobs", "advantages", *_TOKEN),
    ),
    Metric(
        "grpo_importance_weight", SU,
        "Per-token importance ratio pi_theta/pi_old on loss tokens (dimensionless; 1 = unchanged). Quantiles "
        "0 (min), 0.5, 0.95, 0.99, 1 (max) of the last update: the mean hides e^5 outliers.",
        S, inputs=("logprobs", "old_logprobs", *_TOKEN), quantiles=RATIO_QUANTILES,
    ),
    Metric(
        "grpo_token_importance_weight", H,
        "Per-token importance ratio pi_theta/pi_old on loss tokens as a histogram, cumulative (buckets 0.25, then "
        "dense around 1 from +-1/2 to +-1/128, then 2 and 4; an overflowed ratio counts in +Inf but not in _sum).",
        S, inputs=("logprobs", "old_logprobs", *_TOKEN), buckets=RATIO_BUCKETS,
    ),
    Metric(
        "grpo_groups_total", C,
        "Prompt groups observed.",
        S, "groups", inputs=("rewards",),
    ),
    Metric(
        "grpo_zero_variance_groups_total", C,
        "Groups whose rewards are all equal (no task gradient), split all_correct / all_incorrect (unknown "
        "without `correct`): the same share calls for opposite fixes.",
        S, "groups", labels=(Label("outcome", ZERO_VARIANCE_OUTCOMES),), inputs=("rewards",),
    ),
    Metric(
        "grpo_zero_variance_groups_ratio", GA,
        "Share of the last batch's groups with zero reward variance.",
        S, "ratio", inputs=("rewards",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_zero_variance_groups_expected_ratio", GA,
        "Predicted zero-variance share E[p^G + (1-p)^G] over the batch's prompts, the expectation taken over "
        "each prompt's Beta posterior of p from its own history (an unseen prompt: over the Beta fitted to the "
        "solve rates seen lately). The observed share is abnormal only well above this, not above a fixed 50%.",
        S, "ratio", inputs=("zero_variance_prob",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_all_incorrect_groups_expected_ratio", GA,
        "The all-incorrect part of the zero-variance prediction, E[(1-p)^G] over the batch's prompts (same "
        "posteriors). The field notes read the two sides apart: all-correct groups beyond their prediction are data "
        "too easy or a policy learning faster than its history; all-incorrect beyond theirs a verifier or "
        "ability problem, or a policy repeating one answer.",
        S, "ratio", inputs=("all_incorrect_prob",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_zero_advantage_tokens_ratio", GA,
        "Share of the last update's loss tokens with zero advantage: they sit in a token-level loss "
        "denominator and dilute the gradient like a smaller batch and learning rate.",
        S, "ratio", inputs=("advantages", *_TOKEN), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_mixed_group_solve_rate_ratio", H,
        "Solve rate (share correct) of groups with mixed outcomes; piled at 0.1 and 0.9 means sigma "
        "normalisation gives the lone minority the largest weight.",
        S, "ratio", inputs=("correct",), buckets=SOLVE_RATE_BUCKETS,
    ),
    Metric(
        "grpo_generated_groups_total", C,
        "Prompt groups a dynamic-sampling loop (DAPO) generated to fill its batches, the kept ones included "
        "(verl's train/num_gen_batches x data.gen_batch_size). grpo_groups_total over it is the kept share; its "
        "inverse the generation overhead, which grows as the prompt pool the policy can still learn from shrinks.",
        S, "groups", inputs=("generated_groups",),
    ),
    Metric(
        "grpo_filtered_groups_total", C,
        "Groups a dynamic-sampling filter dropped for zero reward variance, by composition: all_correct (the "
        "pool being mastered) or all_incorrect (too hard, or a verifier that cannot say yes).",
        S, "groups", labels=(Label("outcome", FILTERED_OUTCOMES),),
        inputs=("filtered_all_correct_groups|filtered_all_incorrect_groups",),
    ),
    Metric(
        "grpo_kept_groups_ratio", GA,
        "Share of the groups generated for the last batch that it kept (its groups over generated_groups; 1 "
        "without a filter). Frozen early-window anchor in grpo_run_anchor: the batch stays full while this falls.",
        S, "ratio", inputs=("rewards", "generated_groups"), merge=Merge.RATIO,
    ),
    # ---- layer 4: does the policy still read the question? ----------------------------------------------
    Metric(
        "grpo_entropy_mean_nats", GA,
        "Mean token entropy over the last update's loss tokens, nats: a coarse alarm, diluted by format tokens. "
        "From per-token `entropy`, or the mean a framework reports when its entropies stay in the workers "
        "(`entropy_mean`: verl, OpenRLHF).",
        D, "nats", inputs=("entropy|entropy_mean", "loss_mask|entropy_mean"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_entropy_top_mean_nats", GA,
        "Mean entropy of the top `entropy_top_fraction` (default 20%) highest-entropy loss positions of the "
        "step, nats: the forking tokens, a fixed-size set comparable across steps.",
        D, "nats", inputs=("entropy", *_TOKEN), merge=Merge.HISTOGRAM,
    ),
    Metric(
        "grpo_token_entropy_nats", H,
        "Per-token entropy on loss tokens as a histogram, nats, cumulative: where the entropy mass sits, "
        "across ranks and windows (buckets 2^-7 to 8).",
        D, "nats", inputs=("entropy", *_TOKEN), buckets=ENTROPY_BUCKETS,
    ),
    Metric(
        "grpo_pass_at_k_ratio", GA,
        "Unbiased pass@k 1 - C(n-c,k)/C(n,k) averaged over all groups of the last rollout batch, before any "
        "zero-variance filtering; k = 1, the group size, and configured k. pass@1 up with pass@G down = "
        "narrowing.",
        D, "ratio", labels=(_K,), inputs=("correct",), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_unique_completions_ratio", GA,
        "Mean over groups of distinct completions / group size (exact token-sequence identity).",
        D, "ratio", inputs=("completion_ids", "completion_lengths"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_repeated_wrong_groups_ratio", GA,
        "Share of the last batch's groups whose samples are all incorrect and at least half of them one same "
        "completion (exact token-sequence identity): prompts answered with one wrong path again and again. Rising "
        "while pass@G falls: prompts losing their last right sample to a narrowed policy (a collapse); rising while "
        "pass@G holds: unsolved prompts narrowing onto one wrong answer.",
        D, "ratio", inputs=("correct", "completion_ids", "completion_lengths"), merge=Merge.RATIO,
    ),
    Metric(
        "grpo_edit_distance_median_ratio", GA,
        "Median normalised token edit distance between completions of the same group, over sampled groups "
        "(computed off the training thread).",
        D, "ratio", inputs=("completion_ids", "completion_lengths"), source=Source.MONITOR,
    ),
    Metric(
        "grpo_retrieval_accuracy_ratio", GA,
        "Share of completions that score highest under their own prompt among the batch's P prompts; near "
        "chance 1/P = template collapse even at high entropy.",
        D, "ratio", inputs=("retrieval_scores",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_retrieval_chance_ratio", GA,
        "Chance level 1/P of the retrieval accuracy for the last evaluated batch.",
        D, "ratio", inputs=("retrieval_scores",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_regression_completions_total", C,
        "Completions of the mastered-prompt regression set evaluated (observe_regression): a small held set of "
        "prompts the policy already solves, checked every K steps, because a run that filters all-correct groups "
        "(DAPO dynamic sampling) no longer sees them in training.",
        D, "completions", inputs=("regression_correct",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_regression_correct_completions_total", C,
        "Correct completions of the mastered-prompt regression set (observe_regression).",
        D, "completions", inputs=("regression_correct",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_regression_accuracy_ratio", GA,
        "Accuracy of the last evaluation of the mastered-prompt regression set; its early window (the mean of "
        "the first regression_anchor_evaluations) is published as grpo_run_anchor. An alarm, not a ruler: a set "
        "of dozens of prompts moves by several points between evaluations.",
        D, "ratio", inputs=("regression_correct",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_regression_evaluated_completions", GA,
        "Completions in the last evaluation of the regression set: the size that sets its accuracy's noise.",
        D, "completions", inputs=("regression_correct",), source=Source.MONITOR,
    ),
    # ---- liveness and the exporter itself ---------------------------------------------------------------
    Metric("grpo_last_step", GA, "Last training step observed.", L, inputs=("step",), source=Source.MONITOR),
    Metric(
        "grpo_last_step_timestamp_seconds", GA,
        "Unix time at which the last step was observed; stall detection.",
        L, "seconds", inputs=("step",), source=Source.MONITOR,
    ),
    Metric("grpo_steps_total", C, "Steps observed.", L, "steps", inputs=("step",), source=Source.MONITOR),
    Metric(
        "grpo_run_finished", GA,
        "1 once close() ran (the run ended normally; close waits up to close_linger_s for one more scrape so "
        "Prometheus sees it), 0 while the run is live: a normal end pages nothing, a dead process still does.",
        L, source=Source.MONITOR,
    ),
    Metric(
        "grpo_observe_duration_seconds", H,
        "Wall time spent inside observe calls, by stage, seconds.",
        L, "seconds", labels=(Label("stage", STAGES),), source=Source.MONITOR, buckets=OBSERVE_BUCKETS,
    ),
    Metric(
        "grpo_exporter_errors_total", C,
        "Errors caught inside the exporter, by stage; training went on.",
        L, "errors", labels=(Label("stage", ERROR_STAGES),), source=Source.MONITOR,
    ),
    Metric(
        "grpo_exporter_compiled_stage_calls_total", C,
        "Stage calls (a rollout, an update) computed by a compiled program; present (from 0) with "
        "compile_step=\"auto\" only.",
        L, "calls", source=Source.MONITOR,
    ),
    Metric(
        "grpo_exporter_compiled_fallbacks_total", C,
        "Stage calls at or above compile_min_positions that the eager step served instead of a compiled "
        "program (compile_step=\"auto\"), by reason: pending (its program is being compiled, off the training "
        "thread), busy (the compiler held its lock), recompile (the call would have recompiled: refused, compiled "
        "in the background), late (a non-finite log-prob on a loss token: counts only the eager step takes), "
        "compiler or run (compiling or running failed, or the training compiles code of its own: no new "
        "program, logged once). The readings are the same either way; a steady rate other than pending at start "
        "costs speed, not data. Present (from 0) with compile_step=\"auto\" only.",
        L, "fallbacks", labels=(Label("reason", COMPILE_FALLBACKS),), source=Source.MONITOR,
    ),
    Metric(
        "grpo_dropped_reward_components_total", C,
        "Reward component observations dropped because more components than max_reward_components were given.",
        L, "components", source=Source.MONITOR,
    ),
    Metric(
        "grpo_dropped_micro_steps_total", C,
        "Update micro-steps dropped because more than max_pending_micro_steps were given in one step (a step "
        "that never ends: call end_step() or clip_grad_norm_ once per optimizer step).",
        L, "steps", source=Source.MONITOR,
    ),
    Metric(
        "grpo_run_anchor", GA,
        "The run's own early window, frozen: the mean of a metric's first anchor_steps (20) values (entropy, "
        "pass@k, rewards, ESS, in-group diversity), published once complete, for rules that must not follow "
        "a slow drift or absorb a persistent fault into a trailing baseline. Labels as grpo_reference_baseline.",
        L, labels=(Label("metric", bound="anchored families"), Label("labels", bound="their sample labels")),
        source=Source.MONITOR,
    ),
    Metric(
        "grpo_preflight_check_passed", GA,
        "1 when the last run of a preflight check (grpo_exporter.checks, published with "
        "GRPOMonitor.publish_check) passed, 0 when it failed or could not tell: the 0/1 tests before any "
        "curve (fix, never tune). Absent until a check is published.",
        G, labels=(Label("check", PREFLIGHT_CHECKS),), inputs=("preflight_report",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_preflight_check_cannot_tell", GA,
        "1 when the last run of a preflight check could not judge (an empty or all-masked batch, non-finite "
        "values: its diagnosis says which), 0 when it passed or failed. A check that sees nothing never passes.",
        G, labels=(Label("check", PREFLIGHT_CHECKS),), inputs=("preflight_report",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_recorder_incidents_total", C,
        "Incidents the flight recorder wrote (recorder_dir): last normal, first anomalous and next step of each "
        "episode of layer-1 triggers, for `grpo-exporter inspect` (the three states to save before reading any curve).",
        G, "incidents", inputs=("recorder_dir",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_recorder_latest_incident_step", GA,
        "First anomalous step of the latest incident written, labelled with its directory name (`incident`) "
        "and the recorder directory (`directory`, its last 128 characters); one series at a time. Layer-1 "
        "alert descriptions show it. No prompt or completion text ever goes into a label.",
        G, labels=(Label("incident", bound="the latest incident only"), Label("directory", bound="recorder_dir")),
        inputs=("recorder_dir",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_recorder_disk_usage_bytes", GA,
        "Bytes held by complete incidents in recorder_dir after the latest write (kept within "
        "recorder_disk_budget_bytes by removing the oldest incidents first).",
        L, "bytes", inputs=("recorder_dir",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_recorder_removed_incidents_total", C,
        "Incidents removed, oldest first, to keep recorder_dir within recorder_disk_budget_bytes.",
        L, "incidents", inputs=("recorder_dir",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_reading_rollouts", GA,
        "Rollouts held in the run's reading set (reading_rows per kind and window: the highest rewards, the "
        "fastest-rising component, truncations, repeated and low-entropy groups, a control), served at /reading on "
        "the metrics port by the serving rank; every page of layers 1-4 links them, from `scheme` and the "
        "scrape's `instance`. Absent where nothing serves. Text is kept only with reading_text.",
        L, labels=(Label("scheme", ("http", "https")),), inputs=("reading_rows",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_reference_baseline", GA,
        "Value of a metric in a known-good reference run (reference_baseline config), for baseline-relative "
        "rules: `metric` is the catalogue family, `labels` the sample's labels as written in the key.",
        L, labels=(Label("metric", bound="reference_baseline keys"), Label("labels", bound="reference_baseline keys")),
        inputs=("reference_baseline",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_kl_penalty_coefficient", GA,
        "The run's KL-to-reference penalty coefficient (setting kl_coef: TRL's beta, verl's kl_loss_coef or "
        "kl_ctrl.kl_coef); absent without one. The KL rules judge grpo_kl_ref_nats only where it is above 0.",
        L, inputs=("kl_coef",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_run_info", GA,
        "Constant 1 labelled with the run's group size, clip range, advantage normalisation, the ratio the loss "
        "weights by (token, or sequence for GSPO) and its clip (ppo, cap for CISPO, none for SAPO/VESPO), so rules "
        "and dashboards can read the model predictions' parameters (e.g. the (G-1)/sqrt(G) bound) and what the "
        "clip metrics measure.",
        L, labels=(
            Label("group_size", bound=ONE_PER_RUN),
            Label("clip_eps_low", bound=ONE_PER_RUN),
            Label("clip_eps_high", bound=ONE_PER_RUN),
            Label("advantage_norm", ADVANTAGE_FORMS, bound=ONE_PER_RUN),
            Label("ratio_level", ("token", "sequence"), bound=ONE_PER_RUN),
            Label("clip", ("ppo", "cap", "none"), bound=ONE_PER_RUN),
        ),
        inputs=("group_size", "clip_eps_low", "clip_eps_high", "advantage_norm", "ratio_level", "clip"),
        source=Source.MONITOR,
    ),
    Metric(
        "grpo_reward_component_role", GA,
        "Constant 1 naming the reward component that measures correctness (correctness_component config, e.g. "
        "the verifier's reward function), so the reward-hack alert reads it whatever it is called.",
        L, labels=(Label("component", bound=ONE_PER_RUN), Label("role", ("correctness",))),
        inputs=("correctness_component",), source=Source.MONITOR,
    ),
    Metric(
        "grpo_build_info", GA,
        "Constant 1 labelled with the exporter and torch versions.",
        L, labels=(Label("version", bound="package version"), Label("torch_version", bound="torch version")),
        source=Source.MONITOR,
    ),
)

_NAME = re.compile(r"^grpo_[a-z][a-z0-9_]*[a-z0-9]$")
_LABEL = re.compile(r"^[a-z][a-z0-9_]*$")
_RESERVED_LABELS = {"run", "job", "instance", "quantile", "le"}


def validate(metrics: tuple[Metric, ...]) -> None:
    """Raise ``ValueError`` naming the first metric that breaks the naming or label conventions."""
    seen: set[str] = set()
    for m in metrics:
        where = f"catalogue metric {m.name!r}"
        if not _NAME.match(m.name) or "__" in m.name:
            raise ValueError(f"{where}: name must match {_NAME.pattern}")
        if m.name in seen:
            raise ValueError(f"{where}: duplicate name")
        seen.add(m.name)
        if (m.type is MetricType.COUNTER) != m.name.endswith("_total"):
            raise ValueError(f"{where}: '_total' is for counters, and every counter ends in '_total'")
        stem = m.name.removesuffix("_total")
        if m.unit and not stem.endswith(f"_{m.unit}"):
            raise ValueError(f"{where}: unit {m.unit!r} must be the name's suffix")
        if stem.endswith("_ratio") and m.unit != "ratio":
            raise ValueError(f"{where}: '_ratio' names a 0..1 value; set unit='ratio'")
        if not m.help.strip():
            raise ValueError(f"{where}: empty help")
        for label in m.labels:
            if not _LABEL.match(label.name) or label.name in _RESERVED_LABELS:
                raise ValueError(f"{where}: bad or reserved label name {label.name!r}")
            if not label.values and not label.bound:
                raise ValueError(f"{where}: label {label.name!r} needs fixed values or a config bound")
        if (m.type is MetricType.SUMMARY) != bool(m.quantiles):
            raise ValueError(f"{where}: summaries and only summaries declare quantiles")
        if (m.type is MetricType.HISTOGRAM) != bool(m.buckets):
            raise ValueError(f"{where}: histograms and only histograms declare buckets")
        if any(not 0.0 <= q <= 1.0 for q in m.quantiles) or list(m.buckets) != sorted(set(m.buckets)):
            raise ValueError(f"{where}: quantiles must lie in [0, 1]; buckets must increase strictly")
        step_gauge = m.type is MetricType.GAUGE and m.source is Source.STEP
        if step_gauge != (m.merge is not None) or m.merge in (Merge.SUM, Merge.LOCAL):
            raise ValueError(f"{where}: every step gauge, and only a step gauge, declares how it merges across ranks")


validate(CATALOG)

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOG}


_KEY = re.compile(r"^(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)(?:\{(?P<labels>.*)\})?$")
_PAIR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")


def parse_key(key: str) -> tuple[str, dict[str, str]]:
    """(sample name, labels) of a key: read from a :class:`SampleKey`, parsed from text written by a person
    (``'x_sum{a="b"}'`` in a reference-baseline file, a test)."""
    if isinstance(key, SampleKey):
        return key.sample, dict(key.labels)
    return _parse_text_key(key)


@functools.lru_cache(maxsize=4096)
def _parse_text_key(key: str) -> tuple[str, dict[str, str]]:
    match = _KEY.match(key.strip())
    if match is None:
        raise ValueError(f"expected a sample key like name{{label=\"value\"}}, got {key!r}")
    pairs = _PAIR.findall(match["labels"] or "")
    return match["name"], {n: _UNESCAPE.sub(lambda m: "\n" if m[1] == "n" else m[1], v) for n, v in pairs}


def sample_key(key: str) -> SampleKey:
    """A :class:`SampleKey` for ``key`` (itself when it is one), checked against the catalogue."""
    if isinstance(key, SampleKey):
        return key
    name, labels = parse_key(key)
    family = family_of(name)
    return family.key(name.removeprefix(family.name), **labels)


def family_of(sample_name: str) -> Metric:
    """The catalogue family a sample name belongs to (``x_bucket`` -> histogram ``x``)."""
    return _FAMILY_OF_SAMPLE[sample_name]


_FAMILY_OF_SAMPLE: dict[str, Metric] = {}
for _m in CATALOG:
    _suffixes = {MetricType.SUMMARY: ("", "_sum", "_count"), MetricType.HISTOGRAM: ("_bucket", "_sum", "_count")}
    for _suffix in _suffixes.get(_m.type, ("",)):
        _FAMILY_OF_SAMPLE[_m.name + _suffix] = _m


def is_additive(key: str) -> bool:
    """Whether a sample accumulates across steps: counters, and the _sum/_count/_bucket samples."""
    return key.additive if isinstance(key, SampleKey) else _is_additive_sample(parse_key(key)[0])


@functools.lru_cache(maxsize=1024)
def _is_additive_sample(sample: str) -> bool:
    family = family_of(sample)
    return family.type is MetricType.COUNTER or sample != family.name


def key(name: str, **labels: str) -> SampleKey:
    """The sample key of family ``name`` with ``labels`` (:meth:`Metric.key` without a suffix)."""
    return metric(name).key(**labels)


def metric(name: str) -> Metric:
    """The catalogue entry called ``name``; ``KeyError`` with close names when there is none."""
    try:
        return BY_NAME[name]
    except KeyError:
        close = [n for n in BY_NAME if name.removeprefix("grpo_")[:8] in n]
        raise KeyError(f"no catalogue metric {name!r}; similar: {close[:5]}") from None
