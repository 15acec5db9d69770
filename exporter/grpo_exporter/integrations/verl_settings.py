"""What verl's config means here, without importing verl: the :class:`GRPOMonitor` settings it implies
(:func:`monitor_settings`: group size, run name, KL coefficient, and the advantage form of the configured
estimator, :func:`advantage_form` through :data:`ESTIMATOR_FORMS`), the norm the actor clips at and rollout
correction's bypass mode. Read by :mod:`grpo_exporter.integrations.verl`, ``verl_v1`` and ``verl_fully_async``;
:mod:`grpo_exporter.integrations.verl` checks the installed verl against :data:`TESTED`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from grpo_exporter.integrations import IntegrationError

#: the verl releases the adapters are tested with
TESTED = "verl>=0.9.1,<0.10"

#: verl 0.9.1's registered advantage estimators (``algorithm.adv_estimator``, verl.trainer.ppo.core_algos) -> the
#: monitor's ``advantage_norm`` for the advantages each computes from the summed ``token_level_rewards``, and why.
#: Only ``unbiased`` and ``none`` bound |A| per group; where no form's bound holds, a form without one is named,
#: so that GRPOAdvantageAboveBound never pages on what the estimator computes by design: ``batch`` for the
#: group-centred ones (their groups sum to 0), ``whitened`` for those whose groups do not (a group-centred form
#: would read each of their groups as inconsistent: GRPOAdvantageInconsistent).
ESTIMATOR_FORMS: Mapping[str, tuple[str, str]] = {
    "grpo": ("unbiased", "(r - mean_g) / (torch.std_g + 1e-6), unbiased std; with norm_adv_by_std_in_grpo=False "
                         "r - mean_g (none, Dr. GRPO)"),
    "grpo_vectorized": ("unbiased", "(r - mean_g) / (std_g + 1e-6), unbiased std (count - 1); verl's "
                                    "compute_advantage does not pass it norm_adv_by_std_in_grpo: always divided"),
    "rloo": ("batch", "r - the mean of the others = G/(G-1) (r - mean_g): G/(G-1) past the none bound"),
    "rloo_vectorized": ("batch", "r - the mean of the others = G/(G-1) (r - mean_g): G/(G-1) past the none bound"),
    "gpg": ("batch", "(r - mean_g) x batch size / non-zero scores: group-centred, scaled by a batch statistic"),
    "opo": ("whitened", "r - the group's length-weighted mean: not centred, up to the group's whole reward range"),
    "grpo_passk": ("whitened", "each group's best response alone, r_max - r_second (over std_g): not centred, up "
                               "to sqrt(G) or the whole range"),
    "reinforce_plus_plus_baseline": ("whitened", "r - mean_g, then whitened over the batch's tokens"),
    "gdpo": ("whitened", "a group z-score per reward key, summed, then whitened over the batch's tokens"),
    "reinforce_plus_plus": ("whitened", "the return whitened over the batch's tokens (shaped with gamma < 1: "
                                        "discounted per token)"),
    "remax": ("shaped", "the per-token return minus the greedy response's reward"),
    "gae": ("shaped", "per-token GAE from the critic's values, whitened over the batch"),
    "optimal_token_baseline": ("shaped", "the per-token return minus a per-position group baseline"),
    "tir_optimal_token_baseline": ("shaped", "the per-token return minus a per-position group baseline"),
}


def advantage_form(config: Any) -> str:
    """The form (the monitor's ``advantage_norm``) of the advantages verl's config computes:
    ``algorithm.adv_estimator`` through :data:`ESTIMATOR_FORMS`, ``norm_adv_by_std_in_grpo`` for ``grpo``,
    ``gamma`` and ``use_kl_in_reward`` for ``reinforce_plus_plus`` (a discount or a per-token KL penalty makes its
    per-token return vary along the sequence: ``shaped``).

    ``use_kl_in_reward`` changes no other form: the outcome estimators read the summed ``token_level_rewards``
    (score - beta x KL), and those are the rewards the adapters hand the monitor with the advantages. An estimator
    verl 0.9.1 does not register (one of yours) raises :class:`IntegrationError`: the form of its advantages is
    unknown, and a wrong one pages GRPOAdvantageAboveBound on a healthy run; pass ``advantage_norm=``."""
    estimator = _select(config, "algorithm.adv_estimator")
    name = str(getattr(estimator, "value", estimator) or "gae")
    if name == "grpo":
        norm = _select(config, "algorithm.norm_adv_by_std_in_grpo")
        return "unbiased" if norm is None or bool(norm) else "none"
    if name == "reinforce_plus_plus":
        gamma = _select(config, "algorithm.gamma")
        discounted = gamma is not None and float(gamma) != 1.0
        return "shaped" if discounted or _select(config, "algorithm.use_kl_in_reward") else "whitened"
    if name not in ESTIMATOR_FORMS:
        raise IntegrationError(
            f"grpo_exporter.integrations.verl: algorithm.adv_estimator {name!r} is not one verl 0.9.1 registers "
            f"({', '.join(ESTIMATOR_FORMS)}; tested with {TESTED}): the form of its advantages is unknown. Pass "
            "advantage_norm= (unbiased: a group z-score; none: group-centred; batch, whitened or shaped: no "
            "per-group bound) with the monitor's settings.")
    return ESTIMATOR_FORMS[name][0]


def _kl_coef(config: Any) -> float:
    """The KL-to-reference coefficient verl applies: the actor's ``kl_loss_coef`` with ``use_kl_loss``, the
    reward's ``algorithm.kl_ctrl.kl_coef`` with ``use_kl_in_reward``, else 0 (no penalty)."""
    if _select(config, "actor_rollout_ref.actor.use_kl_loss"):
        return float(_select(config, "actor_rollout_ref.actor.kl_loss_coef") or 0.0)
    if _select(config, "algorithm.use_kl_in_reward"):
        return float(_select(config, "algorithm.kl_ctrl.kl_coef") or 0.0)
    return 0.0


def monitor_settings(config: Any, **settings: Any) -> dict[str, Any]:
    """The :class:`GRPOMonitor` settings verl's config gives: ``group_size`` = ``actor_rollout_ref.rollout.n``,
    ``run`` = ``trainer.experiment_name``, ``kl_coef`` (:func:`_kl_coef`), ``advantage_norm``
    (:func:`advantage_form`: an estimator it does not know raises unless you give the form), then ``settings``.
    A setting you give wins: in ``settings``, in a ``GRPO_EXPORTER_*`` variable or in the ``config_file`` named
    in ``settings`` (each of which the monitor would otherwise see overridden by the derived keyword)."""
    derived: dict[str, Callable[[], Any]] = {
        "group_size": lambda: int(_select(config, "actor_rollout_ref.rollout.n") or 1),
        "run": lambda: str(_select(config, "trainer.experiment_name") or "verl"),
        "kl_coef": lambda: _kl_coef(config), "advantage_norm": lambda: advantage_form(config)}
    yours = set(settings) | _set_elsewhere(settings, derived)
    return {**{k: make() for k, make in derived.items() if k not in yours}, **settings}


def _set_elsewhere(settings: Mapping[str, Any], names: Mapping[str, Any]) -> set[str]:
    """The settings among ``names`` that the monitor gets from you outside its keywords: all of them with a whole
    ``config``, those of a ``GRPO_EXPORTER_*`` variable and those of the ``config_file``."""
    from grpo_exporter.config_files import load_yaml_mapping
    from grpo_exporter.runtime.config_environment import ENV_PREFIX

    if settings.get("config") is not None:
        return set(names)
    found = {n for n in names if ENV_PREFIX + n.upper() in os.environ}
    if settings.get("config_file") is not None:
        found |= set(load_yaml_mapping(settings["config_file"], "settings", "config_file")) & set(names)
    return found


def _select(config: Any, key: str) -> Any:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.select(config, key)
    except Exception:
        return None


def _grad_clip(config: Any) -> float | None:
    """The norm verl's actor clips at: ``actor_rollout_ref.actor.optim.clip_grad`` (what verl's engines read),
    else the deprecated ``actor.grad_clip`` (verl copies it there); None when neither is set."""
    value = _select(config, "actor_rollout_ref.actor.optim.clip_grad")
    if value is None:
        value = _select(config, "actor_rollout_ref.actor.grad_clip")
    return float(value) if value is not None else None


def _bypass(config: Any) -> bool:
    """``algorithm.rollout_correction.bypass_mode`` of verl's config."""
    return bool(_select(config, "algorithm.rollout_correction.bypass_mode"))


def _routing_replay(config: Any) -> bool:
    """MoE routing replay R3: ``actor_rollout_ref.rollout.enable_rollout_routing_replay`` (verl runs it only with a
    ``router_replay.mode`` of R3; the batch's ``routed_experts`` are then the engine's)."""
    return bool(_select(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay"))
