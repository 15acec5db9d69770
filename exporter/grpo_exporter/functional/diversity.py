"""Layer 4, "does the policy still read the question?": entropy, pass@k, in-group distinct completions.

Seed sections: 第 2 篇 (diversity monitoring) §1 (mean entropy, a coarse alarm), §4 (entropy of the top-20% most
uncertain positions, a fixed-size set), §3 (pass@k with k = group size, computed before zero-variance filtering),
§2 (distinct completions within a group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.constants import cached_constant, constant, table
from grpo_exporter.functional.groups import Groups
from grpo_exporter.functional.histogram import histogram
from grpo_exporter.functional.histogram_host import TopMean
from grpo_exporter.functional.reading import Ratio, count, finite_or_zero, fraction, sum64


class Entropy(NamedTuple):
    mean: Ratio
    top_mean: TopMean


def entropy_stats(masked: Tensor, tokens: Tensor, top_fraction: float) -> Entropy:
    """Mean token entropy over finite loss tokens, and the mean over the top ``top_fraction`` of them, from the
    entropy on loss tokens (fp32, 0 elsewhere) and ``tokens``, its finite loss tokens: a non-finite entropy
    reads 0 and is out of the count."""
    kept = finite_or_zero(masked)
    top = TopMean(histogram(kept, None, exact_min=False, kept=kept, valid_count=tokens), top_fraction)
    return Entropy(fraction(sum64(kept), tokens), top)


def pass_at_k(correct: Tensor, groups: Groups, k: int) -> Ratio:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) per group (Chen et al. 2021), averaged over every group
    with n >= k. The ratio is the product over i < k of (n-c-i)/(n-i), clamped at 0 once n-c-i <= 0."""
    return Ratio(*pass_at_ks(correct, groups, (k,)).terms(0))


def pass_at_ks(correct: Tensor, groups: Groups, ks: Sequence[int]) -> Ratio:
    """:func:`pass_at_k` for every k of ``ks`` at once: a :class:`Ratio` of (len(ks),) numerators and
    denominators. The running product over i < max(ks) is taken once and read at each k."""
    n = groups.sizes().double()
    c = groups.count(correct).double()
    i = constant(range(max(ks)), torch.float64, correct.device)
    terms = ((n - c).unsqueeze(1) - i).clamp(min=0.0) / (n.unsqueeze(1) - i).clamp(min=1.0)
    k = constant(ks, torch.float64, correct.device)
    none_passes = terms.cumprod(dim=1)[:, constant([x - 1 for x in ks], torch.int64, correct.device)]
    eligible = n.unsqueeze(1) >= k
    return fraction(torch.where(eligible, 1.0 - none_passes, 0.0).sum(dim=0), count(eligible, 0))


_TABLE = 1 << 17  # positions whose multipliers are one table per device, which a compiled stage takes as is


@cached_constant(maxsize=32)
def _multipliers(width: int, device: str) -> Tensor:
    """(width,) fixed random odd 64-bit multipliers, one per position (seeded: the same in every process): the
    first ``width`` of one table up to :data:`_TABLE` positions (sliced, so a traced width may be symbolic)."""
    if width <= _TABLE:
        return _multiplier_table(device)[:width]
    return _random_odd(width).to(device)


@table
def _multiplier_table(device: str) -> Tensor:
    return _random_odd(_TABLE).to(device)


def _random_odd(width: int) -> Tensor:
    gen = torch.Generator().manual_seed(0x6772706F)
    return torch.randint(-(2**62), 2**62, (width,), generator=gen, dtype=torch.int64) * 2 + 1


def sequence_hashes(completion_ids: Tensor, positions: Tensor) -> Tensor:
    """(N,) int64 fingerprint of each completion: sum_t (token_t + 1) m_t over the tokens at ``positions``,
    wrapping modulo 2^64 (int64 arithmetic wraps), with m_t fixed random odd multipliers. Two different
    completions collide with probability ~2^-64; a difference confined to one position never cancels (an odd
    multiplier is invertible mod 2^64), and one of another length has terms (token + 1 >= 1) the other lacks.
    One multiply and one row sum: O(N T) in three passes."""
    width = completion_ids.shape[1]
    ids = completion_ids if completion_ids.dtype == torch.int64 else completion_ids.long()
    tokens = (ids + 1).mul_(positions).mul_(_multipliers(width, str(completion_ids.device)))
    return tokens.sum(dim=1)


_GROUP_MIX = 0x9E3779B97F4A7C15 - 2**64  # an odd 64-bit constant (as int64): mixes the group into the key


class Repeats(NamedTuple):
    """The batch's completions sorted by their key (fingerprint and group): ``order`` (N,) the rows in that order,
    ``first`` (N,) int64 1 where a new completion starts in it. Equal neighbours are the repeats."""

    order: Tensor
    first: Tensor


def repeats(completion_ids: Tensor, positions: Tensor, groups: Groups) -> Repeats:
    """:class:`Repeats` of the batch: one key per completion, fingerprint + group x an odd constant (mod 2^64:
    completions of different groups collide with probability ~2^-64 too), one sort. Remembered per
    ``completion_ids`` for this grouping: the distinct-completion share and the reading set's repeated groups
    read one sort. No host sync."""
    return groups.remembered("repeats", completion_ids, lambda: _repeats(completion_ids, positions, groups))


def _repeats(completion_ids: Tensor, positions: Tensor, groups: Groups) -> Repeats:
    key = sequence_hashes(completion_ids, positions).add_(groups.index * _GROUP_MIX)
    order = torch.argsort(key)
    ordered = key[order]
    first = torch.ones(ordered.shape[0], dtype=torch.int64, device=key.device)
    first[1:] = ordered[1:] != ordered[:-1]
    return Repeats(order, first)


def unique_completion_ratio(completion_ids: Tensor, positions: Tensor, groups: Groups) -> Ratio:
    """Mean over groups of (distinct completions in the group) / (group size), by exact token identity up
    to the hash above (:func:`repeats`)."""
    order, first = repeats(completion_ids, positions, groups)
    distinct = torch.zeros(groups.bins, dtype=torch.int64, device=first.device).index_add_(
        0, groups.index[order], first
    )
    sizes = groups.sizes()
    populated = sizes > 0
    share = torch.where(populated, distinct.double() / sizes.clamp(min=1).double(), 0.0)
    return fraction(share.sum(), populated.sum())


def copies_in_group(completion_ids: Tensor, positions: Tensor, groups: Groups) -> Tensor:
    """(N,) int64: how many completions of each row's group are token for token the row's own (itself included),
    from the sort the distinct-completion share made (:func:`repeats`). Remembered per ``completion_ids`` for
    this grouping (the repeated-wrong share and the reading set's repeated groups read it)."""
    return groups.remembered("copies", completion_ids, lambda: _copies(repeats(completion_ids, positions, groups)))


def _copies(rep: Repeats) -> Tensor:
    run = rep.first.cumsum(0) - 1
    sizes = torch.zeros_like(run).index_add_(0, run, torch.ones_like(run))
    return torch.empty_like(run).scatter_(0, rep.order, sizes[run])


def repeated_wrong_groups(copies: Tensor, correct: Tensor, groups: Groups) -> Ratio:
    """Share of the batch's groups whose samples are all incorrect and at least half of them (two at least) one
    same completion, token for token: prompts the policy answers with one wrong path, again and again.

    The collapse's own count (seed 第 2 篇 (diversity monitoring) ②③: distinct completions fall while pass@k
    falls): a prompt that loses its last right sample to a policy narrowed onto one path turns into such a group.
    In a run that learns, an all-wrong group carries no advantage, so no update rewards narrowing it; where
    the unsolved prompts narrow all the same (a policy sharpening everywhere), pass@G holds, which the rules
    read beside it. ``copies`` from :func:`copies_in_group`, ``correct`` (N,) bool or 0/1; a group of one never
    counts (two copies at least)."""
    sizes = groups.sizes()
    most = groups.amax(copies, copies > 0)
    repeated = (sizes > 0) & (groups.count(correct) == 0) & (most >= 2) & (2 * most >= sizes)
    return fraction(repeated.sum(), (sizes > 0).sum())


def retrieval_accuracy(scores: Tensor, own_prompt: Tensor) -> Ratio:
    """Share of completions that score strictly highest under their own prompt (seed 第 2 篇 (diversity monitoring) §5).

    ``scores`` (N, P): a user score of completion i under prompt j (e.g. its log-prob given prompt j);
    ``own_prompt`` (N,): the column of each completion's own prompt. Rows whose own score is not finite are
    skipped. Chance level is 1/P; near it, answers no longer depend on the question (template collapse).
    """
    s = scores.float()
    own = s.gather(1, own_prompt.long().unsqueeze(1)).squeeze(1)
    others = s.scatter(1, own_prompt.long().unsqueeze(1), -torch.inf).amax(dim=1)
    valid = torch.isfinite(own)
    return fraction((valid & (own > others)).sum(), valid.sum())
