"""Mixture-of-experts routing, trainer against engine (:mod:`grpo_exporter.functional.routing`): the per-layer,
per-decision and per-token shares of differently routed loss tokens, the engine gap split by routing, each side's
expert load, and the monitor publishing them (the published numbers: ~10% of decisions and 94% of tokens differ on
Qwen3-30B-A3B with a bf16 engine, arXiv 2510.11370)."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import routing
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.step import compute_step


def _experts(n: int, t: int, layers: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * t * layers)]).view(n, t, layers, k)


def test_shares_count_expert_sets_on_loss_tokens_layer_by_layer() -> None:
    """A decision differs when the *set* of k experts differs (the order within it does not matter); tokens off
    the loss mask and decisions a side did not record (a negative id) are left out of both counts."""
    trainer = _experts(4, 5, 3, 2, 8)
    engine = trainer.flip(-1).clone()  # the same sets in another order: nothing differs
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[:, 4] = False
    engine[0, 0, 1] = torch.tensor([e for e in range(8) if e not in trainer[0, 0, 1].tolist()][:2])
    engine[1, 2, 0, 0] = -1  # not recorded by the engine: (row 1, token 2, layer 0) is not compared
    engine[2, 4, 2] = (trainer[2, 4, 2] + 1) % 8  # off the loss mask
    m = routing.routing_mismatch(trainer, engine, mask)
    assert m.compared.item() == 16 * 3 - 1
    assert m.differing.item() == 1
    assert m.unrecorded.item() == 1  # routed by the trainer, no route from the engine: a fallback under replay
    assert m.layers.value.tolist() == pytest.approx([0.0, 1 / 16, 0.0])
    assert m.decisions.value.item() == pytest.approx(1 / 47)
    assert m.tokens.value.item() == pytest.approx(1 / 16)


def test_the_comparison_by_layer_chunks_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers go a few at a time (bounded temporaries for 48+ layers): the readings do not depend on it."""
    trainer, engine = _experts(6, 7, 9, 2, 16, 1), _experts(6, 7, 9, 2, 16, 2)
    engine[:3] = trainer[:3]
    mask = torch.rand(6, 7, generator=torch.Generator().manual_seed(3)) > 0.3
    whole = routing.routing_mismatch(trainer, engine, mask)
    monkeypatch.setattr(routing, "CHUNK_ELEMENTS", 6 * 7 * 2 * 2)  # two layers a chunk
    chunked = routing.routing_mismatch(trainer, engine, mask)
    assert torch.equal(whole.layers.value, chunked.layers.value)
    assert whole.differing.item() == chunked.differing.item()
    assert whole.compared.item() == chunked.compared.item()
    assert torch.equal(whole.token_differs, chunked.token_differs)


def test_the_gap_splits_by_the_tokens_routing() -> None:
    """The mean gap on tokens routed alike everywhere, on those routed differently somewhere, and the share of the
    gap's sum the latter carry: how much of the gap routing explains."""
    trainer = _experts(2, 3, 2, 1, 4)
    engine = trainer.clone()
    engine[0, 1, 1] = (trainer[0, 1, 1] + 1) % 4
    mask = torch.ones(2, 3, dtype=torch.bool)
    gap = torch.full((2, 3), 0.01)
    gap[0, 1] = 0.5
    split = routing.gap_by_routing(gap, mask, routing.routing_mismatch(trainer, engine, mask))
    assert split.agrees.value.item() == pytest.approx(0.01)
    assert split.differs.value.item() == pytest.approx(0.5)
    assert split.differs_share.value.item() == pytest.approx(0.5 / 0.55)


def test_expert_load_reads_one_for_an_even_split_and_e_for_a_collapsed_router() -> None:
    e = 4
    even = torch.arange(e).repeat(2).view(2, 4, 1, 1)  # every expert takes 2 of 8 slots
    collapsed = even.clone()
    collapsed[:, :, 0, 0] = 3
    mask = torch.ones(2, 4, dtype=torch.bool)
    assert routing.expert_load_peak(even, mask, e).value.item() == pytest.approx(1.0)
    both = torch.cat([even, collapsed], dim=2)  # the worst layer is reported
    assert routing.expert_load_peak(both, mask, e).value.item() == pytest.approx(e)
    outside = even.clone()
    outside[0, 0, 0, 0] = 99  # an id past moe_experts is left out, never an index error
    assert routing.expert_load_peak(outside, mask, e).value.item() == pytest.approx(2 / 7 * e)
    assert not routing.expert_load_peak(even, torch.zeros(2, 4, dtype=torch.bool), e).present.item()
    wide = torch.arange(256, dtype=torch.uint8).view(2, 4, 1, 32)  # uint8 ids of 256 experts: no wrapped range check
    assert routing.expert_load_peak(wide, mask, 256).value.item() == pytest.approx(1.0)


def test_a_dense_step_publishes_no_routing_and_an_moe_step_publishes_every_reading() -> None:
    mask = torch.ones(8, 6, dtype=torch.bool)
    old = -torch.rand(8, 6, generator=torch.Generator().manual_seed(0))
    base = {"rewards": torch.rand(8), "loss_mask": mask, "old_logprobs": old, "rollout_logprobs": old + 0.01}
    cfg = MetricsConfig(group_size=4, moe_experts=8)
    assert not any("routing" in str(k) or "expert" in str(k) for k in compute_step(StepInputs(**base), cfg))
    trainer = _experts(8, 6, 3, 2, 8)
    engine = trainer.clone()
    engine[:, :, 2, 0] = (trainer[:, :, 2, 1] + 1) % 8  # layer 2 routes every token differently (or the same set)
    got = compute_step(StepInputs(**base, routed_experts=trainer, rollout_routed_experts=engine, routing_replay=True),
                       cfg)
    differs = (trainer[:, :, 2].sort(-1).values != engine[:, :, 2].sort(-1).values).any(-1).float().mean().item()
    assert got['grpo_routing_mismatch_ratio{moe_layer="2"}'] == pytest.approx(differs)
    assert got['grpo_routing_mismatch_ratio{moe_layer="0"}'] == 0.0
    assert got["grpo_routing_decision_mismatch_ratio"] == pytest.approx(differs / 3)
    assert got["grpo_routing_replay_enabled"] == 1.0
    assert 'grpo_engine_logprob_gap_by_routing_mean_nats{routing="agrees"}' in got


def test_routed_experts_need_layers_and_experts() -> None:
    for shape in ((4, 3, 0, 2), (4, 3, 2, 0)):
        with pytest.raises(InputError, match="layers and k at least 1"):
            StepInputs(loss_mask=torch.ones(4, 3, dtype=torch.bool),
                       routed_experts=torch.zeros(shape, dtype=torch.long))


def test_the_monitor_counts_routed_experts_past_max_moe_layers_as_an_error_naming_the_setting() -> None:
    """Inside training, too many layers is an error counted and logged (strict mode raises), never a crash."""
    experts = _experts(4, 3, 5, 1, 4)
    kwargs = {"rewards": torch.rand(4), "loss_mask": torch.ones(4, 3, dtype=torch.bool), "routed_experts": experts,
              "rollout_routed_experts": experts}
    with GRPOMonitor(run="moe", group_size=4, port=None, close_linger_s=0, max_moe_layers=4) as mon:
        mon.observe_rollout(0, **kwargs)
        published = mon.metrics()
        assert published['grpo_exporter_errors_total{stage="rollout"}'] == 1
        assert "grpo_routing_decision_mismatch_ratio" not in published
    with GRPOMonitor(run="moe", group_size=4, port=None, close_linger_s=0, max_moe_layers=4, strict=True) as mon, \
            pytest.raises(InputError, match="max_moe_layers=4"):
        mon.observe_rollout(0, **kwargs)


def test_the_run_anchors_its_early_routing_mismatch() -> None:
    """The early levels GRPORoutingMismatchRising compares with: the means of the first anchor_steps rollouts."""
    trainer = _experts(4, 3, 2, 1, 4)
    engine = trainer.clone()
    engine[0, :, 0] = (trainer[0, :, 0] + 1) % 4  # 3 of 24 decisions differ
    with GRPOMonitor(run="moe", group_size=4, port=None, close_linger_s=0, anchor_steps=2) as mon:
        for step in range(3):
            mon.observe_rollout(step, rewards=torch.rand(4), loss_mask=torch.ones(4, 3, dtype=torch.bool),
                                routed_experts=trainer, rollout_routed_experts=engine, routing_replay=False)
        anchors = {str(k): v for k, v in mon.metrics().items() if str(k).startswith("grpo_run_anchor")}
    assert anchors['grpo_run_anchor{metric="grpo_routing_decision_mismatch_ratio",labels=""}'] == pytest.approx(3 / 24)
    # and each layer's own (GRPORoutingMismatchRising's per-layer leg): layer 0 differs on 3 of 12 tokens
    assert anchors['grpo_run_anchor{metric="grpo_routing_mismatch_ratio",labels="moe_layer=\'0\'"}'] == 0.25
    assert anchors['grpo_run_anchor{metric="grpo_routing_mismatch_ratio",labels="moe_layer=\'1\'"}'] == 0.0
