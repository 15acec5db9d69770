"""The demo trainer at the metric level: it learns, and each deterministic fault shows up in the
exporter's own metrics within a few steps of injection."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.demo import model
from grpo_exporter.demo.engine import RolloutEngine
from grpo_exporter.demo.model import bf16_linear
from grpo_exporter.demo.scenarios import SCENARIOS
from grpo_exporter.demo.task import EOS, FIRST_SYMBOL, SEP, TOOL_LENGTH, Task
from grpo_exporter.demo.trainer import DemoConfig, Trainer, warm_snapshot

STEPS_AFTER = 4


@functools.cache
def warm(seed: int) -> dict[str, object]:
    """The warm-started state of a seed (deterministic), shared by the tests."""
    snapshot = warm_snapshot(DemoConfig(seed=seed))
    assert snapshot["accuracy"] >= DemoConfig().warmup_target  # mixed groups from the first RL step
    return snapshot


def run_scenario(name: str, steps_before: int = 3) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = DemoConfig(seed=2)
    with GRPOMonitor(run=name, group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=None, guard="off",
                     log_ratio_clamp=cfg.log_ratio_clamp, edit_distance_groups=0) as mon:
        trainer = Trainer(cfg, mon)
        trainer.restore(warm(cfg.seed))
        for step in range(steps_before):
            trainer.step(step)
        SCENARIOS[name].inject(trainer)
        for step in range(steps_before, steps_before + STEPS_AFTER):
            trainer.step(step)
        mon.flush()
        return dict(mon.metrics())


def test_every_scenario_is_documented():
    assert set(SCENARIOS) == {
        "healthy", "healthy-reverse", "engine-top-p", "engine-temperature", "engine-stale-weights", "mask-bug",
        "exp-before-clamp",
        "grad-accum-scaling", "advantage-bug", "reward-hack", "entropy-collapse", "stale-rollouts", "truncation",
        "verifier-broken", "healthy-tool", "loss-on-tool-tokens", "length-counts-tool-tokens", "pool-shrinks",
        "healthy-moe", "moe-router-stale", "moe-replay-drops-layer",
    }
    for s in SCENARIOS.values():
        assert s.name.startswith("healthy") or (s.expected_alerts and s.layer), s.name
        assert not s.name.startswith("healthy") or not s.expected_alerts, s.name


def test_healthy_run_has_no_layer_one_fault_and_learns():
    m = run_scenario("healthy", steps_before=10)
    assert m['grpo_nonfinite_values_total{tensor="logprobs"}'] == 0
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    # the engine computes in bf16: its gap is noise at the level of real bf16 stacks (0.010-0.018, TRL #5312),
    # zero-mean (the signed gap, k1, is second order) and the correction weights average 1
    assert 0.005 < m["grpo_engine_logprob_gap_mean_nats"] < 0.025
    assert abs(m['grpo_mismatch_kl_nats{estimator="k1"}']) < 0.003
    assert m['grpo_mismatch_kl_nats{estimator="k3"}'] < 0.003
    assert m["grpo_onpolicy_outside_clip_ratio"] == 0
    assert m["grpo_advantage_over_bound_sequences_total"] == 0


def test_the_engines_own_kv_cached_path_matches_the_trainer_in_fp32():
    """The engine samples through its own KV-cached decode (RolloutEngine.generate -> TinyLM.decode_step), not
    the trainer's forward: in fp32 the two implementations agree to rounding, so the bf16 gap is the precision's."""
    cfg = replace(DemoConfig(seed=3), engine_precision=torch.float32)
    trainer = Trainer(cfg, monitor=None)  # type: ignore[arg-type]
    trainer.restore(warm(cfg.seed))
    prompts, ids = trainer.task.prompts(8, trainer.generator)
    rollout = trainer.engine.generate(prompts, ids, cfg.group_size, cfg.max_new, trainer.generator)
    with torch.no_grad():
        old, _, _ = trainer._logprobs(rollout)
    mask = torch.arange(old.shape[1]) < rollout.lengths.unsqueeze(1)
    assert (rollout.rollout_logprobs - old)[mask].abs().max() < 1e-4


def test_the_engines_bf16_gemm_is_pytorchs_bf16_linear():
    """The engine's GEMMs (model.bf16_linear: bf16 operands, fp32 accumulation, a bf16 result) give PyTorch's own
    bf16 ``linear`` (on a CPU without bf16 instructions the same bits, ~7x faster), so the demo's engine gap
    is the bf16 one: the engine's logits are those of its decode through ``linear`` in bf16."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for rows, width, out in ((72, 48, 144), (8, 48, 192), (64, 192, 48), (8, 48, 18)):
        x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
        w = (torch.randn(out, width, generator=gen) / width**0.5).to(torch.bfloat16)
        b = torch.randn(out, generator=gen).to(torch.bfloat16)
        ours, native = bf16_linear(x, w, b), torch.nn.functional.linear(x, w, b)
        assert ours.dtype == torch.bfloat16
        # one bf16 rounding step at most (8 significant bits), if a CPU's own kernel sums in another order
        torch.testing.assert_close(ours.float(), native.float(), rtol=2**-7, atol=2**-7)
    cfg = DemoConfig(seed=3)
    trainer = Trainer(cfg, monitor=None)  # type: ignore[arg-type]
    trainer.restore(warm(cfg.seed))
    prompts, _ = trainer.task.prompts(8, trainer.generator)
    tokens = torch.randint(0, trainer.task.vocab, (8, 4), generator=gen)

    def decode(linear: object) -> list[torch.Tensor]:
        """The engine's logits for the prompt and then four given tokens, through its KV cache."""
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            patch.setattr(model, "bf16_linear", linear)
            logits, cache, _ = trainer.engine.model.decode_step(prompts, None)
            found = [logits]
            for i in range(tokens.shape[1]):
                logits, cache, _ = trainer.engine.model.decode_step(tokens[:, i : i + 1], cache)
                found.append(logits)
        return found

    for ours, native in zip(decode(bf16_linear), decode(torch.nn.functional.linear), strict=True):
        assert ours.dtype == native.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), native.float(), rtol=2**-6, atol=2**-6)


def test_a_bf16_trainer_recomputing_one_sequence_a_pass_is_batch_variant_inside_the_clip_band():
    """The premise of the world sweep's batch-variant world: in bf16 the trainer's log-probs depend on the batch
    layout (one row a pass against the 16-row update), as TRL #6789 saw from the chunk size alone; on the demo
    model that is ~0.01 nats mean and ~0.1 max, with no token outside the clip band [0.8, 1.28]."""
    torch.set_num_threads(1)
    cfg = replace(DemoConfig(seed=3), trainer_precision=torch.bfloat16, old_logprob_rows=1)
    trainer = Trainer(cfg, monitor=None)  # type: ignore[arg-type]
    trainer.restore(warm(cfg.seed))
    rollout = trainer._rollout()
    mask = torch.arange(rollout.completions.shape[1]) < rollout.lengths.unsqueeze(1)
    rows = rollout.completions.shape[0] // cfg.micro_batches
    with torch.no_grad():
        old, _ = trainer._old_logprobs(rollout)
        update = torch.cat([trainer._logprobs(rollout, slice(i, i + rows))[0] for i in range(0, len(old), rows)])
        exact = replace(cfg, old_logprob_rows=None)
        trainer.config = exact
        same_layout, _ = trainer._old_logprobs(rollout)
    log_ratio = (update - old)[mask]
    assert 1e-3 < log_ratio.abs().mean() < 0.05
    assert log_ratio.abs().max() < 0.2
    assert abs(log_ratio.mean()) < 0.2 * log_ratio.abs().mean()  # zero-mean: numeric noise, not a second path
    low, high = cfg.clip_eps
    assert not ((log_ratio.exp() < 1 - low) | (log_ratio.exp() > 1 + high)).any()
    assert torch.equal(update[mask], same_layout[mask])  # batched passes of 16 and 64 rows agree bit for bit


@pytest.mark.parametrize(
    ("name", "check"),
    [
        # top-p 0.8: every token's engine log-prob is higher by -log(kept mass): the signed gap is the mean gap
        ("engine-top-p", lambda m: m['grpo_mismatch_kl_nats{estimator="k1"}'] > 0.95 * m[
            "grpo_engine_logprob_gap_mean_nats"] > 0.05),
        ("engine-temperature", lambda m: m['grpo_mismatch_kl_nats{estimator="k3"}'] > 0.01),
        ("engine-stale-weights", lambda m: m["grpo_engine_logprob_gap_mean_nats"] > 5 * 0.015),
        ("mask-bug", lambda m: m["grpo_loss_mask_length_mismatch_sequences_total"] > 0),
        ("exp-before-clamp", lambda m: m['grpo_nonfinite_values_total{tensor="log_ratio"}'] > 0),
        ("advantage-bug", lambda m: m["grpo_advantage_over_bound_sequences_total"] > 0),
        ("stale-rollouts", lambda m: m["grpo_rollout_staleness_versions"] >= STEPS_AFTER - 1),
        ("truncation", lambda m: m["grpo_truncated_completions_total"] >= 0.9 * STEPS_AFTER * 64),
        ("verifier-broken", lambda m: m['grpo_reward_mean{component="correctness"}'] == 0),
    ],
)
def test_fault_shows_in_the_exporter_metrics(name, check):
    assert check(run_scenario(name))


def test_the_multi_turn_task_writes_the_tools_reply_and_its_faults_show():
    """The tool's reply (SEP, the prompt's first symbol) sits at positions 2-3 of every completion that reached
    them, with no engine log-prob; the warm start learns around it (pass@1 at its target), scoring reads the
    model's tokens only; healthy, the audit reads 0 on every reason and the engine gap shows per turn; each
    fault moves its own counter and no other."""
    torch.set_num_threads(1)
    cfg = SCENARIOS["healthy-tool"].config()
    assert (cfg.task.tool_at, cfg.max_new) == (2, DemoConfig().max_new + TOOL_LENGTH)
    readings = {}
    for name in ("healthy-tool", "loss-on-tool-tokens", "length-counts-tool-tokens"):
        with GRPOMonitor(run=name, group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=None, guard="off",
                         edit_distance_groups=0) as mon:
            trainer = Trainer(cfg, mon)
            trainer.restore(warm_tool(cfg.seed))
            SCENARIOS[name].inject(trainer)
            reports = [trainer.step(step) for step in range(4)]
            mon.flush()
            readings[name] = dict(mon.metrics())
        assert sum(r.correct for r in reports) / 4 > 0.1, name  # the model's own tokens are scored
    prompts, ids = trainer.task.prompts(4, trainer.generator)
    rollout = trainer._generate(prompts, ids, 2, cfg.max_new)
    assert rollout.tool_mask is not None
    reached = rollout.lengths > 2
    assert torch.equal(rollout.tool_mask[:, 2:4], reached.unsqueeze(1).expand(-1, 2))
    assert not rollout.tool_mask[:, :2].any()
    assert not rollout.tool_mask[:, 4:].any()
    assert (rollout.completions[reached, 2] == SEP).all()
    assert torch.equal(rollout.completions[reached, 3], rollout.prompts[reached, 1])
    assert (rollout.rollout_logprobs[rollout.tool_mask] == 0).all()
    healthy, on_tool, span = (readings[n] for n in ("healthy-tool", "loss-on-tool-tokens", "length-counts-tool-tokens"))
    reasons = ("grpo_loss_mask_tool_tokens_total", "grpo_completion_length_tool_span_sequences_total",
               "grpo_loss_mask_length_mismatch_sequences_total", "grpo_loss_mask_outside_completion_tokens_total")
    assert [healthy[r] for r in reasons] == [0, 0, 0, 0]
    assert {'grpo_engine_logprob_gap_turn_mean_nats{turn="1"}',
            'grpo_engine_logprob_gap_turn_mean_nats{turn="2"}'} <= set(healthy)
    assert on_tool[reasons[0]] > 0
    assert [on_tool[r] for r in reasons[1:]] == [0, 0, 0]
    assert span[reasons[1]] > 0
    assert [span[r] for r in reasons if r != reasons[1]] == [0, 0, 0]


def test_the_dynamic_sampling_loop_keeps_mixed_groups_and_counts_what_it_filtered():
    """DAPO's loop in the demo: the trained batch is prompts_per_step groups, each with both outcomes while the
    rounds suffice; the monitor counts every generated and filtered group; the stuck sampler serves its 4
    prompts only."""
    torch.set_num_threads(1)
    cfg = SCENARIOS["pool-shrinks"].config()
    assert cfg.dynamic_sampling
    generated = filtered = 0
    with GRPOMonitor(run="ds", group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=None, guard="off",
                     edit_distance_groups=0) as mon:
        trainer = Trainer(cfg, mon)
        trainer.restore(warm(cfg.seed))
        for step in range(4):
            rollout = trainer._rollout()
            hits = trainer._rewards(rollout)[0].view(-1, cfg.group_size).sum(dim=1)
            assert rollout.completions.shape[0] == cfg.prompts_per_step * cfg.group_size
            counts = trainer._filter
            if counts["generated_groups"] < cfg.dynamic_sampling_rounds * cfg.prompts_per_step:
                assert ((hits > 0) & (hits < cfg.group_size)).all(), step
            trainer.step(step)
            done = trainer._filter
            generated += done["generated_groups"]
            filtered += done["filtered_all_correct_groups"] + done["filtered_all_incorrect_groups"]
        mon.flush()
        m = dict(mon.metrics())
        SCENARIOS["pool-shrinks"].inject(trainer)
        assert len(set(trainer._prompts(64)[1].tolist())) <= 4
    assert m["grpo_generated_groups_total"] == generated > 4 * cfg.prompts_per_step - 1
    assert sum(v for k, v in m.items() if k.startswith("grpo_filtered_groups_total")) == filtered


@functools.cache
def warm_tool(seed: int) -> dict[str, object]:
    snapshot = warm_snapshot(SCENARIOS["healthy-tool"].config(seed))
    assert snapshot["accuracy"] >= DemoConfig().warmup_target
    return snapshot


def test_the_reverse_task_has_one_right_answer():
    task = SCENARIOS["healthy-reverse"].config().task
    gen = torch.Generator().manual_seed(0)
    prompts, _ = task.prompts(64, gen)
    answer = task.answers(prompts, gen)
    lengths = torch.full((64,), task.answer_length)
    assert task.score(prompts, answer, lengths).all()
    body = prompts[:, 1 : 1 + task.length]
    other = torch.cat([body, answer[:, -1:]], dim=1)  # the same symbols in prompt order: a permutation
    palindrome = (body == body.flip(1)).all(dim=1)
    assert not task.score(prompts, other, lengths)[~palindrome].any()
    assert SCENARIOS["healthy"].config().task.score(prompts, other, lengths).all()  # the permutation task takes it


def test_the_conflict_task_has_two_rules_no_symbol_tells_apart():
    """The conflict family (tests/worlds.py): reversed on half of the prompts, any order but reversed on the
    other half, the halves chosen by a hash of the whole prompt."""
    task = Task(symbols=6, length=3, kind="conflict")
    gen = torch.Generator().manual_seed(0)
    prompts, _ = task.prompts(512, gen)
    body = prompts[:, 1 : 1 + task.length]
    lengths = torch.full((512,), task.answer_length)
    eos = torch.full((512, 1), EOS)
    assert task.score(prompts, task.answers(prompts, gen), lengths)[~(body == body[:, :1]).all(dim=1)].all()
    reversed_ = task.score(prompts, torch.cat([body.flip(1), eos], dim=1), lengths)
    rotated = task.score(prompts, torch.cat([body.roll(1, 1), eos], dim=1), lengths)
    distinct = (body[:, 0] != body[:, 1]) & (body[:, 1] != body[:, 2]) & (body[:, 0] != body[:, 2])
    assert not (reversed_ & rotated)[distinct].any()  # one rule or the other, never both
    assert 0.4 < reversed_.float().mean() < 0.6  # half of the prompts
    for position in range(task.length):  # no symbol in any position decides the rule
        for symbol in range(FIRST_SYMBOL, FIRST_SYMBOL + task.symbols):
            rows = body[:, position] == symbol
            assert 0.25 < reversed_[rows].float().mean() < 0.75


def test_the_reverse_task_is_learned_into_all_correct_groups():
    """The second task family: from the warm start, GRPO drives the reverse task to mostly all-correct groups
    with identical completions (the regime the rules must not read as collapse; tests/test_e2e.py checks no
    alert fires in Prometheus)."""
    torch.set_num_threads(1)
    cfg = SCENARIOS["healthy-reverse"].config(0)
    with GRPOMonitor(run="reverse", group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=None, guard="off",
                     log_ratio_clamp=cfg.log_ratio_clamp, edit_distance_groups=0) as mon:
        trainer = Trainer(cfg, mon)
        trainer.restore(warm_snapshot(cfg))
        reports = [trainer.step(step) for step in range(160)]
        m = mon.metrics()
    assert sum(r.correct for r in reports[-20:]) / 20 > 0.9
    assert m['grpo_zero_variance_groups_total{outcome="all_correct"}'] > 3 * m[
        'grpo_zero_variance_groups_total{outcome="all_incorrect"}']
    assert m["grpo_unique_completions_ratio"] < 0.3  # converged toward one completion per group


@functools.cache
def warm_moe(seed: int) -> dict[str, object]:
    return warm_snapshot(SCENARIOS["healthy-moe"].config(seed))


def test_an_moe_engine_routes_as_its_trainer_up_to_its_precision_and_replay_reproduces_its_routing():
    """The engine's KV-cached path routes each fed position: in fp32 as the trainer's forward does, in bf16 a few
    near-ties otherwise; a trainer forward that replays the engine's routing uses exactly its experts."""
    torch.manual_seed(0)
    policy = model.TinyLM(12, context=16, experts=8, top_k=2)
    prompts, generator = torch.randint(0, 10, (8, 6)), torch.Generator().manual_seed(0)
    for precision, most in ((torch.float32, 0.0), (torch.bfloat16, 0.05)):
        rollout = RolloutEngine(policy, precision).generate(prompts, torch.arange(8), 2, 6, generator)
        assert rollout.routing is not None
        assert rollout.routing.shape == (16, 6 + 6 - 1, 2, 2)
        fed = torch.cat([rollout.prompts, rollout.completions], dim=1)[:, :-1]
        _, own = policy.routed(fed)
        differ = (own.sort(-1).values != rollout.routing.sort(-1).values).any(-1).float().mean().item()
        assert differ <= most, (precision, differ)
        _, replayed = policy.routed(fed, replay=rollout.routing)
        assert torch.equal(replayed, rollout.routing)


def _moe_run(name: str, steps: int, inject_at: int) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    cfg = SCENARIOS[name].config()
    readings = []
    with GRPOMonitor(run=name, port=None, guard="off", edit_distance_groups=0, **cfg.monitor_settings()) as mon:
        trainer = Trainer(cfg, mon)
        trainer.restore(warm_moe(cfg.seed))
        for step in range(steps):
            if step == inject_at:
                SCENARIOS[name].inject(trainer)
            trainer.step(step)
            readings.append({str(k): v for k, v in mon.metrics().items()})
    return readings


def test_the_moe_scenarios_move_the_routing_readings_their_alerts_read():
    """healthy-moe: a steady small share of differing decisions; moe-router-stale: it rises well above its early
    level once the routers go stale; moe-replay-drops-layer: nothing differs while the replay covers every
    layer, then only the layer it leaves out (layer 1) differs."""
    healthy = _moe_run("healthy-moe", 40, -1)
    shares = [r["grpo_routing_decision_mismatch_ratio"] for r in healthy]
    assert max(shares) < 0.02
    assert healthy[-1]["grpo_routing_replay_enabled"] == 0
    assert healthy[-1]['grpo_expert_load_peak_multiple{side="engine"}'] >= 1.0
    stale = _moe_run("moe-router-stale", 150, 40)
    def share(first: int, last: int) -> float:  # differing over compared decisions, steps first..last
        d, c = "grpo_routing_differing_decisions_total", "grpo_routing_compared_decisions_total"
        before = stale[first - 1] if first else {d: 0.0, c: 0.0}
        return (stale[last][d] - before[d]) / (stale[last][c] - before[c])

    early, late_share = share(0, 39), share(110, 149)
    assert late_share > max(2 * early, early + 0.02), (early, late_share)
    replay = _moe_run("moe-replay-drops-layer", 40, 10)
    assert replay[9]["grpo_routing_differing_decisions_total"] == 0
    assert replay[9]["grpo_routing_replay_enabled"] == 1
    assert replay[-1]["grpo_routing_differing_decisions_total"] > 0
    assert all(r['grpo_routing_mismatch_ratio{moe_layer="0"}'] == 0 for r in replay)
