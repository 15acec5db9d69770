"""Layer 2: which form the step's advantages follow, and so which |A| bound is theirs to keep.

Seed section 2.2 bounds |A| by (G-1)/sqrt(G) (above it: "a data or reward bug") for group-std-normalised
advantages. Estimators compute other forms, whose healthy advantages exceed that bound: a group-centred reward
(Dr. GRPO), a batch-wide std (TRL ``scale_rewards="batch"``), batch whitening (REINFORCE++-baseline), a reward
shaped per token (the KL penalty in the reward, GAE). The bound is a premise, so it is checked on the data: the
step's advantages, taken per sequence over the complete groups (G members each, every advantage finite), are
sorted into the form they follow, and the bound applied is that form's.

The form is told from the advantages alone (group means, group stds, per-token variation), and, where the
rewards of the same sequences come with them, from the advantages against the rewards:

* ``shaped``: most multi-token sequences carry advantages that vary from token to token;
* ``unbiased`` / ``population``: every group's advantages are centred, no group's std (unbiased / population)
  is above 1 (an eps in std + eps only lowers it) and most groups with a spread sit at 1 (90%): no group can
  exceed its bound;
* ``none`` (group-centred) / ``batch`` (group-centred over one batch-wide scale): centred groups whose std is the
  reward's (none) or the reward's over one common factor (batch); without rewards, centred groups whose stds
  differ from group to group (a scale that follows the rewards), read as the configured one of the two if it is
  one of them, else ``none``; either with a mean square advantage of 1 over the batch (without rewards; batch
  with them) is ``whitened``, whose batch mean came out ~0;
* ``whitened``: uncentred groups that all share one mean (batch whitening of group-centred rewards), or, with
  rewards, advantages affine in the reward over the whole batch (whitening without a group baseline);
* ``unknown``: none of these. A scale applied after normalisation (every group's std the same factor, not 1),
  misaligned groups, advantages of another batch: the configured form's bound still judges them.

Every test but ``shaped`` needs two groups with a spread at least: one group fits any mean, line or unit std.

The detected form's bound judges the complete groups it was read from; fragments of groups (a micro-batch that
split them) and every group of a step of unknown form keep the configured form's. A known form other than the
configured one is reported (an info alert and a log line: set ``advantage_norm``).
Inconsistent sequences are counted apart: with rewards, an advantage that ranks its completion against its
reward within the group, or moves where the group's rewards tie; under a configured group-centred form, a
member of a group whose advantages do not sum to 0 (the groups handed over are not the estimator's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.catalog import ADVANTAGE_FORMS
from grpo_exporter.config import AdvantageNorm
from grpo_exporter.functional.groups import Groups, GroupStats, advantage_bounds, group_stats
from grpo_exporter.functional.reading import count, filled, finite

#: the forms a step's advantages are sorted into: the settings' forms, then "unknown"
FORMS = (*ADVANTAGE_FORMS, "unknown")
UNKNOWN = FORMS.index("unknown")
#: the forms with a per-group |A| bound (seed 2.2), and the group-centred ones (advantages sum to 0 per group)
BOUNDED = ("unbiased", "population", "none")
CENTRED = ("unbiased", "population", "none", "batch")

#: configured form -> detected forms its healthy data can look like, reported as the configured one: a batch
#: scale or whitening over a batch whose mean advantage is 0 leaves group-centred advantages over one factor
COMPATIBLE: dict[str, tuple[str, ...]] = {
    "batch": ("none", "whitened"),
    # a sum of per-function group z-scores (TRL normalize_then_sum) whose groups share one spread, whitened
    "whitened": ("none", "batch", "unbiased", "population"),
}
#: a group's advantages are centred / tied when within this share of the batch's RMS advantage: the rounding
#: std normalisation leaves on a tied group is ~1e-3 of a unit advantage
CENTRE_RTOL = 1e-2
#: the largest group std of a std-normalised form lies in [UNIT_LOW, 1 + slack]
UNIT_LOW = 0.98
#: the groups with a spread a form test needs at least: one group fits any mean, line or unit std by chance
MIN_GROUPS = 2
#: share of the groups with a reward spread whose advantage std is 1 for a std-normalised form
UNIT_SHARE = 0.9
#: relative agreement of per-group scales (none: 1; batch: one common factor) and of an affine fit's residual
SCALE_RTOL = 1e-2
#: how far from 1 the mean square advantage of a batch-whitened step may lie (its weights are the tokens', the
#: check's the sequences')
WHITE_RTOL = 0.08
#: share of multi-token sequences whose advantage varies along the sequence for the form to be ``shaped``
SHAPED_SHARE = 0.5


class SequenceAdvantages(NamedTuple):
    """Per sequence (N,): the advantage (fp64; the mean over finite loss tokens of per-token ones), whether it
    exists, and whether it varies along the sequence (max - min above 1e-5 x (1 + |A|)) with two or more tokens."""

    value: Tensor
    exists: Tensor
    varies: Tensor
    multi: Tensor


def sequence_advantages(advantages: Tensor, loss_mask: Tensor | None) -> SequenceAdvantages:
    """One advantage per sequence and whether it is constant along the sequence."""
    if advantages.dim() == 1:
        a = advantages.double()
        exists = torch.isfinite(a)
        never = torch.zeros_like(exists)
        return SequenceAdvantages(torch.where(exists, a, 0.0), exists, never, never)
    valid = finite(advantages)
    if loss_mask is not None:
        valid = valid & loss_mask
    tokens = count(valid, 1)
    mean = filled(advantages, valid, 0.0).sum(dim=1, dtype=torch.float64) / tokens.clamp(min=1)
    top = filled(advantages, valid, -torch.inf).amax(dim=1).double()
    bottom = filled(advantages, valid, torch.inf).amin(dim=1).double()
    multi = tokens > 1
    varies = multi & ((top - bottom) > 1e-5 * (1.0 + mean.abs()))
    return SequenceAdvantages(mean, tokens > 0, varies, multi)


class FormCheck(NamedTuple):
    """What the form check found: ``form`` (0-d int64, an index into :data:`FORMS`), ``checked`` (0-d int64:
    sequences of complete groups it read; 0 = no form reading), ``bounds`` (per bin, fp64: the |A| bound of the
    form the step is judged by, +inf where none) and ``inconsistent`` (N,) bool."""

    form: Tensor
    checked: Tensor
    bounds: Tensor
    inconsistent: Tensor


def _all(condition: Tensor, where: Tensor) -> Tensor:
    return (condition | ~where).all()


def _unit(std: Tensor, mixed: Tensor, upper: float) -> Tensor:
    """Whether the groups' advantages are std-normalised: no ``mixed`` group's std above ``upper``, and at
    least UNIT_SHARE of them at 1 (within [UNIT_LOW, upper]; a group whose reward spread is near the eps of
    std + eps lies below)."""
    at_one = count(mixed & (std >= UNIT_LOW) & (std <= upper))
    return (at_one >= MIN_GROUPS) & (at_one >= UNIT_SHARE * count(mixed)) & _all(std <= upper, mixed)


def _spread_ok(values: Tensor, where: Tensor, rtol: float) -> Tensor:
    """Whether the ``where`` entries of ``values`` all lie within ``rtol`` of their mean (at least one entry)."""
    n = count(where)
    mean = torch.where(where, values, 0.0).sum() / n.clamp(min=1)
    return (n > 0) & _all((values - mean).abs() <= rtol * mean.abs(), where)


def _affine_residual_ok(a: Tensor, r: Tensor, where: Tensor, scale: Tensor) -> Tensor:
    """Whether ``a`` is an increasing affine function of ``r`` over ``where`` (least squares; every residual
    within SCALE_RTOL x ``scale``)."""
    n = count(where).clamp(min=1).double()
    rm = torch.where(where, r, 0.0).sum() / n
    am = torch.where(where, a, 0.0).sum() / n
    dr, da = torch.where(where, r - rm, 0.0), torch.where(where, a - am, 0.0)
    var = (dr * dr).sum()
    slope = torch.where(var > 0, (dr * da).sum() / var.clamp(min=1e-300), 0.0)
    residual = (da - slope * dr).abs()
    return (slope > 0) & _all(residual <= SCALE_RTOL * scale, where)


class _Groups(NamedTuple):
    """The advantages of the complete groups as the form tests read them: ``member`` (N,) sequences read,
    ``a`` (N,) their advantage (0 elsewhere), ``stats`` per group, ``complete`` and ``mixed`` (a spread above
    ``atol``) per group, ``atol`` the centring tolerance and ``scale`` the RMS advantage (0-d)."""

    member: Tensor
    a: Tensor
    stats: GroupStats
    complete: Tensor
    mixed: Tensor
    atol: Tensor
    scale: Tensor


def _read_groups(seq: SequenceAdvantages, groups: Groups, group_size: int) -> _Groups:
    complete = (groups.sizes() == group_size) & (groups.count(seq.exists) == group_size)
    member = seq.exists & complete[groups.index]
    a = torch.where(member, seq.value, 0.0)
    scale = (a.square().sum() / count(member).clamp(min=1)).sqrt()
    atol = CENTRE_RTOL * scale + 1e-12
    stats = group_stats(torch.where(member, seq.value, torch.nan), groups)
    return _Groups(member, a, stats, complete, complete & (stats.unbiased_std > atol), atol, scale)


class _Scaled(NamedTuple):
    """The tests that tell a group-centred form's scale, and the sequences against their rewards."""

    none: Tensor
    batch: Tensor
    affine: Tensor
    inconsistent: Tensor


def _against_rewards(g: _Groups, rewards: Tensor, groups: Groups, group_size: int, centred: Tensor) -> _Scaled:
    """With the sequences' rewards: the per-group scale k = std(A) / std(r) (none: 1 everywhere; batch: one
    common factor, two groups at least), an affine fit of A on r over the batch (whitening without a group
    baseline), and the sequences whose advantage ranks them against their reward or moves in a tied group."""
    r_ok = g.member & torch.isfinite(rewards)
    rewarded = g.complete & (groups.count(r_ok) == group_size)
    r = torch.where(r_ok, rewards.double(), 0.0)
    r_stats = group_stats(torch.where(r_ok, rewards.double(), torch.nan), groups)
    r_tol = 1e-5 * (r.abs().amax() if r.numel() else g.scale * 0) + 1e-12
    spread = g.mixed & rewarded & (r_stats.unbiased_std > r_tol)
    k = g.stats.unbiased_std / r_stats.unbiased_std.clamp(min=1e-300)
    none = centred & (count(spread) >= MIN_GROUPS) & _all((k - 1.0).abs() <= SCALE_RTOL, spread)
    batch = centred & (count(spread) >= MIN_GROUPS) & _spread_ok(k, spread, SCALE_RTOL)
    in_rewarded = r_ok & rewarded[groups.index]
    affine = (count(spread) >= MIN_GROUPS) & _affine_residual_ok(g.a, r, in_rewarded, g.scale)
    d = g.a - g.stats.mean[groups.index]
    c = r - r_stats.mean[groups.index]
    tied = (r_stats.range <= r_tol)[groups.index]
    against = ((d * c < 0) & (d.abs() > g.atol) & (c.abs() > r_tol)) | (tied & (d.abs() > g.atol))
    return _Scaled(none, batch, affine, in_rewarded & against)


def _without_rewards(g: _Groups, centred: Tensor, configured: AdvantageNorm) -> _Scaled:
    """Without rewards: centred groups whose stds differ (a scale that follows the rewards) are group-centred,
    read as the configured one of none and batch (none if neither); one std shared by every group, not 1, is a
    scale applied after normalisation (no form)."""
    varied = (count(g.mixed) >= MIN_GROUPS) & ~_spread_ok(g.stats.unbiased_std, g.mixed, SCALE_RTOL)
    never = torch.zeros_like(centred)
    batch = centred & varied & (configured == "batch")
    return _Scaled(centred & varied & (configured != "batch"), batch, never, torch.zeros_like(g.member))


def advantage_form(
    advantages: Tensor, loss_mask: Tensor | None, rewards: Tensor | None, groups: Groups, group_size: int,
    configured: AdvantageNorm, bound_rtol: float,
) -> FormCheck:
    """Sort the step's advantages into a form (module docstring), the |A| bound each group is judged by, and
    the inconsistent sequences. ``group_size``: the rollout's G (smaller groups are fragments, read by no form
    test and judged by the configured form's bound with G members); ``bound_rtol``: the bound's relative slack,
    which also caps how far above 1 a z-score's group std may lie. No host sync."""
    seq = sequence_advantages(advantages, loss_mask)
    g = _read_groups(seq, groups, group_size)
    varying = count(seq.varies & g.member)
    centred = _all(g.stats.mean.abs() <= g.atol, g.complete)
    upper = 1.0 + max(1e-5, min(bound_rtol, 1.0 / (4 * group_size)))
    mean_of_means = torch.where(g.complete, g.stats.mean, 0.0).sum() / count(g.complete).clamp(min=1)
    common_mean = _all((g.stats.mean - mean_of_means).abs() <= g.atol, g.complete) & (count(g.mixed) >= MIN_GROUPS)
    scaled = (_without_rewards(g, centred, configured) if rewards is None
              else _against_rewards(g, rewards, groups, group_size, centred))
    # a centred batch over one scale whose std over the batch is 1: whitening whose batch mean came out ~0
    unit_batch = (g.a.square().sum() / count(g.member).clamp(min=1) - 1.0).abs() <= WHITE_RTOL
    rescaled = (scaled.batch | (scaled.none if rewards is None else torch.zeros_like(centred))) & unit_batch
    tests = {
        "shaped": (varying > 0) & (varying > SHAPED_SHARE * count(seq.multi & g.member)),
        "unbiased": centred & _unit(g.stats.unbiased_std, g.mixed, upper),
        "population": centred & _unit(g.stats.population_std, g.mixed, upper),
        "none": scaled.none & ~rescaled, "batch": scaled.batch & ~rescaled,
        "whitened": (~centred & (common_mean | scaled.affine)) | rescaled,
    }
    checked = count(g.member)
    form = _first(tests, checked, configured)
    inconsistent = scaled.inconsistent
    if configured in CENTRED:
        uncentred = g.complete & (g.stats.mean.abs() > g.atol)
        inconsistent = inconsistent | (g.member & uncentred[groups.index] & (form == UNKNOWN))
    if configured in ("whitened", "shaped"):
        inconsistent = torch.zeros_like(inconsistent)
    inconsistent = inconsistent & (form != FORMS.index("shaped"))
    bounds = form_bounds(form, g.complete, rewards, groups, group_size, configured)
    return FormCheck(form, checked, bounds, inconsistent)


def _first(tests: dict[str, Tensor], checked: Tensor, configured: AdvantageNorm) -> Tensor:
    """The index in FORMS of the first form whose test holds (in ``tests``' order), UNKNOWN when none does or
    nothing was read; a form the configured one can look like (COMPATIBLE) reads as the configured one."""
    form = torch.full((), UNKNOWN, dtype=torch.int64, device=checked.device)
    for name, test in reversed(tests.items()):
        form = torch.where(test, FORMS.index(name), form)
    form = torch.where(checked > 0, form, UNKNOWN)
    for alike in COMPATIBLE.get(configured, ()):
        form = torch.where(form == FORMS.index(alike), FORMS.index(configured), form)
    return form


def form_bounds(form: Tensor, complete: Tensor, rewards: Tensor | None, groups: Groups, group_size: int,
                configured: AdvantageNorm) -> Tensor:
    """Per-bin |A| bound: on the ``complete`` groups the form was read from, the detected form's where it has
    one and none for a detected form without a group bound (batch, whitened, shaped); the configured form's on
    every other group (fragments a micro-batch split, groups with a non-finite advantage) and wherever the
    form is unknown."""
    own = {name: advantage_bounds(rewards, groups, name, group_size) for name in BOUNDED}  # type: ignore[arg-type]
    configured_bound = own[configured] if configured in own else torch.full_like(own["unbiased"], torch.inf)
    bounds = torch.full_like(configured_bound, torch.inf)
    for name, bound in own.items():
        bounds = torch.where(form == FORMS.index(name), bound, bounds)
    return torch.where(complete & (form != UNKNOWN), bounds, configured_bound)
