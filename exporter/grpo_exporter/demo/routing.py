"""The demo's mixture-of-experts routing between engine and trainer: the forward of a dense or MoE policy, what the
trainer's forwards replay (routing replay, R3, and the fault that leaves a layer out of it), and what
``observe_rollout`` is handed."""

from __future__ import annotations

from torch import Tensor

from grpo_exporter.demo.engine import Rollout
from grpo_exporter.demo.model import TinyLM


def forward(net: TinyLM, tokens: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The logits of ``tokens`` and, for an MoE policy, the experts each position was routed to (``replay``: the
    engine's, replayed); a dense policy's routing is None."""
    if net.moe is None:
        return net(tokens), None
    return net.routed(tokens, replay)


def replayed(rollout: Rollout, rows: slice, replay: bool, skipped_layer: int | None) -> Tensor | None:
    """The engine's routing of ``rows`` the trainer's forward replays (-1 on the layer the replay fault leaves
    out, which the trainer then routes itself), or None without replay or routing."""
    if not replay or rollout.routing is None:
        return None
    chosen = rollout.routing[rows]
    if skipped_layer is not None:
        chosen = chosen.clone()
        chosen[:, :, skipped_layer] = -1
    return chosen


def observed(rollout: Rollout, trainer: Tensor | None, prompt_length: int,
             replay: bool) -> tuple[Tensor | None, Tensor | None, bool | None]:
    """``routed_experts``, ``rollout_routed_experts`` and ``routing_replay`` for observe_rollout: each side's experts
    behind each completion token (the fed positions whose logits give its log-prob, from ``prompt_length - 1``);
    Nones for a dense policy."""
    if trainer is None or rollout.routing is None:
        return None, None, None
    start = prompt_length - 1
    return trainer[:, start:], rollout.routing[:, start:], replay
