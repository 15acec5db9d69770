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
  is above 1 (an eps in std + eps only lowers it) and one group sits at 1 at least: no group can exceed its
  bound;
* ``none`` (group-centred) / ``batch`` (group-centred over one batch-wide scale): centred groups whose std is the
  reward's (none) or the reward's over one common factor (batch); without rewards, centred groups whose stds
  differ from group to group (a scale that follows the rewards), read as the configured one of the two if it is
  one of them, else ``none``; either with a mean square advantage of 1 over the batch (without rewards; batch
  with them) is ``whitened``, whose batch mean came out ~0;
* ``whitened``: uncentred groups that all share one mean (batch whitening of group-centred rewards), or, with
  rewards, advantages affine in the reward over the whole batch (whitening without a group baseline);
* ``unknown``: none of these. A scale applied after normalisation (every group's std the same factor, not 1),
  misaligned groups, advantages of another batch: the configured form's bound still judges them.

The scale and whitening tests need two groups at least: one group fits any common factor, mean or line.

The detected form's bound judges every group of G members; fragments of groups (a micro-batch that split them)
and every group of a step of unknown form keep the configured form's. Tied groups (no spread in their
advantages) are no evidence of centring: rounding leaves them a common offset; nor is an uncentred group
holding the step's largest |A| (a clip after normalisation; a scale on it exceeds the bound anyway). A known
form other than the configured one is reported (an info alert and a log line: set ``advantage_norm``).
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
    # a batch-wide std that happens to match one group's own reads as that group's z-score
    "batch": ("none", "whitened", "unbiased", "population"),
    # a sum of per-function group z-scores (TRL normalize_then_sum) whose groups share one spread, whitened
    "whitened": ("none", "batch", "unbiased", "population"),
}
#: a group's advantages are centred / without a spread when within this share of the batch's RMS advantage
CENTRE_RTOL = 1e-2
#: the largest group std of a std-normalised form lies in [UNIT_LOW, 1 + slack]
UNIT_LOW = 0.98
#: the groups a scale or whitening test needs at least: one group fits any common factor, mean or line
MIN_GROUPS = 2
#: relative agreement of per-group scales (none: 1; batch: one common factor) and of an affine fit's residual
SCALE_RTOL = 1e-2
#: how far from 1 the mean square advantage of a batch-whitened step may lie (its weights are the tokens', the
#: check's the sequences')
WHITE_RTOL = 0.08
#: share of multi-token sequences whose advantage varies along the sequence for the form to be ``shaped``, and by
#: how much at least, over the batch's RMS advantage: a KL penalty in the reward early in training, when the KL
#: is ~1e-3 nats a token, moves the returns by a per mille; a value broadcast along the sequence does not move
SHAPED_SHARE = 0.5
SHAPED_RTOL = 1e-5


class SequenceAdvantages(NamedTuple):
    """Per sequence (N,): the advantage (fp64; the mean over finite loss tokens of per-token ones), whether it
    exists, how far it varies along the sequence (max - min over its loss tokens; 0 for per-sequence ones) and
    whether it has two or more tokens."""

    value: Tensor
    exists: Tensor
    spread: Tensor
    multi: Tensor


def sequence_advantages(advantages: Tensor, loss_mask: Tensor | None) -> SequenceAdvantages:
    """One advantage per sequence and whether it is constant along the sequence."""
    if advantages.dim() == 1:
        a = advantages.double()
        exists = torch.isfinite(a)
        return SequenceAdvantages(torch.where(exists, a, 0.0), exists, torch.zeros_like(a), torch.zeros_like(exists))
    valid = finite(advantages)
    if loss_mask is not None:
        valid = valid & loss_mask
    tokens = count(valid, 1)
    mean = filled(advantages, valid, 0.0).sum(dim=1, dtype=torch.float64) / tokens.clamp(min=1)
    top = filled(advantages, valid, -torch.inf).amax(dim=1).double()
    bottom = filled(advantages, valid, torch.inf).amin(dim=1).double()
    multi = tokens > 1
    return SequenceAdvantages(mean, tokens > 0, torch.where(multi, top - bottom, 0.0), multi)


class FormCheck(NamedTuple):
    """What the form check found: ``form`` (0-d int64, an index into :data:`FORMS`), ``checked`` (0-d int64:
    sequences of complete groups it read; 0 = no form reading), ``bounds`` (per bin, fp64: the |A| bound of the
    form the step is judged by, +inf where none) and ``inconsistent`` (N,) bool."""

    form: Tensor
    checked: Tensor
    bounds: Tensor
    inconsistent: Tensor


def bound_slack(advantages: Tensor, rtol: float) -> float:
    """The relative slack of the |A| bound for advantages of this dtype: ``rtol`` (the setting), or the dtype's
    own rounding where it is coarser (a bf16 z-score of a lone minority rounds up to 0.4% above its bound, a
    bf16 group's std as far from 1)."""
    if not advantages.is_floating_point():
        return rtol
    return max(rtol, torch.finfo(advantages.dtype).eps)


def _all(condition: Tensor, where: Tensor) -> Tensor:
    return (condition | ~where).all()


def _unit(std: Tensor, mixed: Tensor, upper: float) -> Tensor:
    """Whether the groups' advantages are std-normalised: no ``mixed`` group's std above ``upper``, and one at 1
    at least (within [UNIT_LOW, upper]). Groups below 1 are z-scores too: a reward spread near the eps of
    std + eps (reward noise, often most groups of a step where the verifier ties) lowers their std; a std above
    1 is what no z-score has."""
    at_one = count(mixed & (std >= UNIT_LOW) & (std <= upper))
    return (at_one > 0) & _all(std <= upper, mixed)


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
    ``atol``) per group, ``judged`` the mixed groups the centring and unit-std tests read (those without a
    clipped advantage), ``atol`` the centring tolerance and ``scale`` the RMS advantage (0-d)."""

    member: Tensor
    a: Tensor
    stats: GroupStats
    complete: Tensor
    mixed: Tensor
    judged: Tensor
    atol: Tensor
    scale: Tensor


def _read_groups(seq: SequenceAdvantages, groups: Groups, group_size: int) -> _Groups:
    complete = (groups.sizes() == group_size) & (groups.count(seq.exists) == group_size)
    member = seq.exists & complete[groups.index]
    a = torch.where(member, seq.value, 0.0)
    scale = (a.square().sum() / count(member).clamp(min=1)).sqrt()
    atol = CENTRE_RTOL * scale + 1e-12
    stats = group_stats(torch.where(member, seq.value, torch.nan), groups)
    mixed = complete & (stats.unbiased_std > atol)
    # an advantage clipped after normalisation (clamp(-c, c)) sits at the step's largest |A|, and its group no
    # longer sums to 0 nor has a unit std, with nothing wrong: such a group is no evidence either way
    top = a.abs().amax() if a.numel() else scale
    at_top = member & (a.abs() >= top * (1.0 - 1e-6))
    clipped = (groups.count(at_top) > 0) & (stats.mean.abs() > atol)
    return _Groups(member, a, stats, complete, mixed, mixed & ~clipped, atol, scale)


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
    unit_scale = min(SCALE_RTOL, 0.5 / max(group_size - 1, 1))  # RLOO's G/(G-1) is no 1, however large G
    none = centred & (count(spread) >= MIN_GROUPS) & _all((k - 1.0).abs() <= unit_scale, spread)
    batch = centred & (count(spread) >= MIN_GROUPS) & _spread_ok(k, spread, SCALE_RTOL)
    in_rewarded = r_ok & rewarded[groups.index]
    affine = (count(spread) >= MIN_GROUPS) & _affine_residual_ok(g.a, r, in_rewarded, g.scale)
    d = g.a - g.stats.mean[groups.index]
    c = r - r_stats.mean[groups.index]
    tied = (r_stats.range == 0)[groups.index]  # a near-tie is a spread std normalisation scales up, as it should
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
    varying = count(seq.multi & g.member & (seq.spread > SHAPED_RTOL * g.scale))
    # tied groups are no evidence of centring: an fp32 group mean one ulp off leaves every member of a tied group
    # of partial-credit rewards the same non-zero advantage (verl's eps 1e-6 scales it to 0.03-0.8)
    centred = _all(g.stats.mean.abs() <= g.atol, g.judged)
    shifted = ~_all(g.stats.mean.abs() <= g.atol, g.mixed)  # a clip does not shift every group: whitening does
    upper = 1.0 + max(1e-5, min(bound_slack(advantages, bound_rtol), 1.0 / (4 * group_size)))
    # whitening shifts every complete group, tied ones included, by one mean: two groups show it
    mean_of_means = torch.where(g.complete, g.stats.mean, 0.0).sum() / count(g.complete).clamp(min=1)
    common_mean = (_all((g.stats.mean - mean_of_means).abs() <= g.atol, g.complete) & (count(g.mixed) > 0)
                   & (count(g.complete) >= MIN_GROUPS))
    scaled = (_without_rewards(g, centred, configured) if rewards is None
              else _against_rewards(g, rewards, groups, group_size, centred))
    # a centred batch over one scale whose std over the batch is 1: whitening whose batch mean came out ~0
    unit_batch = (g.a.square().sum() / count(g.member).clamp(min=1) - 1.0).abs() <= WHITE_RTOL
    rescaled = (scaled.batch | (scaled.none if rewards is None else torch.zeros_like(centred))) & unit_batch
    # one group with a spread (a solve rate near 1): centred, not a z-score, a mean square of 1 over the batch
    lone = centred & unit_batch & (count(g.mixed) == 1)
    tests = {
        "shaped": (varying > 0) & (varying > SHAPED_SHARE * count(seq.multi & g.member)),
        "unbiased": centred & _unit(g.stats.unbiased_std, g.judged, upper),
        "population": centred & _unit(g.stats.population_std, g.judged, upper),
        "none": scaled.none & ~rescaled, "batch": scaled.batch & ~rescaled,
        "whitened": (shifted & (common_mean | scaled.affine)) | rescaled | lone,
    }
    checked = count(g.member)
    form = _first(tests, checked, configured)
    inconsistent = scaled.inconsistent
    if configured in CENTRED:
        uncentred = g.judged & (g.stats.mean.abs() > g.atol)
        inconsistent = inconsistent | (g.member & uncentred[groups.index] & (form == UNKNOWN))
    if configured in ("whitened", "shaped"):
        inconsistent = torch.zeros_like(inconsistent)
    inconsistent = inconsistent & (form != FORMS.index("shaped"))
    bounds = form_bounds(form, groups.sizes() == group_size, rewards, groups, group_size, configured)
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


def form_bounds(form: Tensor, whole: Tensor, rewards: Tensor | None, groups: Groups, group_size: int,
                configured: AdvantageNorm) -> Tensor:
    """Per-bin |A| bound: on the ``whole`` groups (G members, whether or not each has a finite advantage: a row
    whose loss mask overlong filtering emptied is still its group's), the detected form's where it has one and
    none for a detected form without a group bound (batch, whitened, shaped); the configured form's on fragments
    of groups (a micro-batch that split them) and wherever the form is unknown. Under a configured ``none``
    (Dr. GRPO), group-centred advantages over one common factor (a detected batch) keep the range bound: a scale
    applied after centring is the bug it is there for."""
    own = {name: advantage_bounds(rewards, groups, name, group_size) for name in BOUNDED}  # type: ignore[arg-type]
    configured_bound = own[configured] if configured in own else torch.full_like(own["unbiased"], torch.inf)
    bounds = torch.full_like(configured_bound, torch.inf)
    for name, bound in own.items():
        bounds = torch.where(form == FORMS.index(name), bound, bounds)
    if configured == "none":
        bounds = torch.where(form == FORMS.index("batch"), own["none"], bounds)
    return torch.where(whole & (form != UNKNOWN), bounds, configured_bound)
