"""Layer 1, mixture-of-experts routing: the router is a second probability path between engine and trainer.

A dense model's token has one probability path; an MoE token's log-prob also depends on which k experts each
MoE layer routes it to, and the rollout engine (bf16 or FP8 kernels, another top-k implementation) and the
trainer route near-ties differently. Reported for Qwen3-30B-A3B (arXiv 2510.11370): ~10% of router decisions
differ, 94% of tokens differ in at least one layer, and the k3 mismatch is 1.5e-3 against 6.4e-4 for dense
Qwen3-8B; plain GRPO runs collapsed until routing replay (the trainer replays the engine's routing, R3) roughly
halved it. So the readings here are of the routing itself, beside the engine gap they explain:

* the share of loss tokens whose *set* of experts differs, per MoE layer (the order within a token's k does not
  matter), over all (token, layer) decisions, and over tokens (differing in at least one layer);
* the engine gap on tokens whose routing agrees everywhere against those where it differs, and the share of the
  gap's sum on the latter: how much of the gap routing explains;
* each side's expert load: the most-loaded expert's share of the routed slots, as a multiple of an even split
  (1 = even, E/k = one expert in every token's k), in the worst layer: a collapsed router shows.

A negative id is a decision not recorded (padding, a route the engine did not return: NeMo-RL's fallback
sentinel -1): that (token, layer) is left out of the comparison, and where only the engine's is missing it is
counted apart (under routing replay the trainer then routed the token itself). Pure tensor math on the inputs'
device, a few layers at a time, no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.reading import Extreme, Ratio, count, fraction, sum64

#: the comparison goes a few layers at a time, so that its temporaries stay near this many elements whatever L is
CHUNK_ELEMENTS = 1 << 24


class RoutingMismatch(NamedTuple):
    """Trainer against engine routing on the loss tokens. ``layers``: a (L,) ratio, differing over compared
    tokens per MoE layer; ``decisions``: differing over compared (token, layer) pairs, with its two counts;
    ``unrecorded``: (token, layer) pairs the trainer routed and the engine recorded no route for; ``tokens``:
    tokens differing in at least one compared layer over tokens compared in any; ``token_differs`` and
    ``token_compared``: those (N, T) masks, for the gap split."""

    layers: Ratio
    decisions: Ratio
    differing: Tensor
    compared: Tensor
    unrecorded: Tensor
    tokens: Ratio
    token_differs: Tensor
    token_compared: Tensor


def _chunks(ids: Tensor) -> range:
    """The first layer of each chunk of layers whose temporaries stay near CHUNK_ELEMENTS."""
    n, t, layers, k = ids.shape
    return range(0, layers, max(1, CHUNK_ELEMENTS // max(1, n * t * k)))


def routing_mismatch(trainer: Tensor, engine: Tensor, loss_mask: Tensor) -> RoutingMismatch:
    """Compare the (N, T, L, k) expert ids of both sides on the (N, T) loss mask, layer chunk by layer chunk."""
    n, t = loss_mask.shape
    differ_layers, compared_layers, unrecorded = [], [], []
    token_differs = torch.zeros(n, t, dtype=torch.bool, device=trainer.device)
    token_compared = torch.zeros_like(token_differs)
    on_loss = loss_mask.unsqueeze(-1)
    chunks = _chunks(trainer)
    for start in chunks:
        a = trainer[:, :, start:start + chunks.step].to(torch.int64).sort(dim=-1).values
        b = engine[:, :, start:start + chunks.step].to(torch.int64).sort(dim=-1).values
        routed, captured = (a >= 0).all(dim=-1), (b >= 0).all(dim=-1)
        recorded = routed & captured & on_loss  # (N, T, chunk)
        differs = (a != b).any(dim=-1) & recorded
        differ_layers.append(differs.sum(dim=(0, 1)))
        compared_layers.append(recorded.sum(dim=(0, 1)))
        unrecorded.append((routed & ~captured & on_loss).sum())
        token_differs |= differs.any(dim=-1)
        token_compared |= recorded.any(dim=-1)
    per_layer_differ = torch.cat(differ_layers)
    per_layer_compared = torch.cat(compared_layers)
    differing, compared = per_layer_differ.sum(), per_layer_compared.sum()
    return RoutingMismatch(
        fraction(per_layer_differ, per_layer_compared), fraction(differing, compared), differing, compared,
        torch.stack(unrecorded).sum(), fraction(count(token_differs), count(token_compared)), token_differs,
        token_compared,
    )


class GapByRouting(NamedTuple):
    """The mean |engine gap| on compared tokens whose routing agrees in every layer, and where it differs in
    one or more; ``differs_share``: the share of the gap's sum those tokens carry."""

    agrees: Ratio
    differs: Ratio
    differs_share: Ratio


def gap_by_routing(gap: Tensor, scored: Tensor, routing: RoutingMismatch) -> GapByRouting:
    """Split the (N, T) absolute engine gap (``scored``: loss tokens with a finite gap) by the tokens' routing."""
    on = scored & routing.token_compared
    apart = on & routing.token_differs
    together = on & ~routing.token_differs
    gap_apart = sum64(torch.where(apart, gap, 0.0))
    gap_together = sum64(torch.where(together, gap, 0.0))
    return GapByRouting(
        fraction(gap_together, count(together)), fraction(gap_apart, count(apart)),
        fraction(gap_apart, gap_apart + gap_together),
    )


def expert_load_peak(ids: Tensor, loss_mask: Tensor, experts: int) -> Extreme:
    """The most-loaded expert's share of one side's routed slots on the loss tokens, times ``experts`` (an even
    split reads 1; on few tokens an even router reads above it, a sampling maximum), in the layer where it is
    largest; absent without a routed loss token. Ids outside 0..experts-1 are left out (a negative one is a
    decision not recorded). Layer chunk by layer chunk, each in int64 (a narrow id dtype would wrap the range
    check)."""
    peaks, presence = [], []
    mask = loss_mask[:, :, None, None]
    chunks = _chunks(ids)
    for start in chunks:
        chunk = ids[:, :, start:start + chunks.step].to(torch.int64)
        layers = chunk.shape[2]
        valid = (chunk >= 0) & (chunk < experts) & mask
        offsets = torch.arange(layers, device=ids.device).mul_(experts).view(1, 1, layers, 1)
        loads = torch.zeros(layers * experts, dtype=torch.float32, device=ids.device)
        loads.index_add_(0, (chunk.clamp(0, experts - 1) + offsets).reshape(-1), valid.reshape(-1).to(torch.float32))
        loads = loads.view(layers, experts)
        slots = loads.sum(dim=1)
        peaks.append(torch.where(slots > 0, loads.amax(dim=1) * experts / slots.clamp_min(1.0), 0.0).amax())
        presence.append((slots > 0).any())
    present = torch.stack(presence).any()
    return Extreme(torch.where(present, torch.stack(peaks).amax(), 0.0), present, largest=True)
