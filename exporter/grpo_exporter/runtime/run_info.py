"""The samples that describe the run rather than a step: build, run settings, reference baseline."""

from __future__ import annotations

import torch

from grpo_exporter import __version__, catalog
from grpo_exporter.runtime.monitor_config import MonitorConfig


def static_values(config: MonitorConfig) -> dict[str, float]:
    """``grpo_build_info``, ``grpo_run_info``, ``grpo_run_finished`` 0 (live), the event counters at 0,
    ``grpo_kl_penalty_coefficient`` when one is configured, ``grpo_reward_component_role`` when a correctness
    component is configured and one
    ``grpo_reference_baseline`` per configured key."""
    values: dict[str, float] = {
        catalog.metric("grpo_run_finished").key(): 0.0,
        # a counter exists from the start, so that its first increment is an increase Prometheus can see
        catalog.metric("grpo_grad_norm_spike_steps_total").key(): 0.0,
        catalog.metric("grpo_grad_norm_spike_confirmed_steps_total").key(): 0.0,
        catalog.metric("grpo_param_update_jump_steps_total").key(): 0.0,
        catalog.metric("grpo_stale_update_steps_total").key(): 0.0,
        catalog.metric("grpo_build_info").key(version=__version__, torch_version=torch.__version__): 1.0,
        catalog.metric("grpo_run_info").key(
            group_size=str(config.group_size), clip_eps_low=repr(config.clip_eps_low),
            clip_eps_high=repr(config.clip_eps_high), advantage_norm=config.advantage_norm,
            ratio_level=config.ratio_level, clip=config.clip,
        ): 1.0,
    }
    if config.kl_coef is not None:
        values[catalog.key("grpo_kl_penalty_coefficient")] = float(config.kl_coef)
    if config.correctness_component is not None:
        role = catalog.metric("grpo_reward_component_role")
        values[role.key(component=config.correctness_component, role="correctness")] = 1.0
    baseline = catalog.metric("grpo_reference_baseline")
    for key, value in config.reference_baseline.items():
        name, labels = catalog.parse_key(key)
        text = ",".join(f"{k}='{v}'" for k, v in labels.items())
        values[baseline.key(metric=name, labels=text)] = float(value)
    return values
