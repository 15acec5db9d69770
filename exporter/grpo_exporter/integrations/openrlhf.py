"""OpenRLHF: the rollout side from its ``Experience`` batches, the update side from ``ppo_train``'s status.

An ``Experience`` carries ``sequences`` (the whole observation: prompt, actions and, in multi-turn agents, the
environment's feedback), ``action_mask`` over ``sequences[:, 1:]`` (B, T-1: 1 on the model's tokens),
``action_log_probs`` (the trainer's, before the update: old), ``base_action_log_probs`` (reference; only with
``--algo.kl.use_loss``), ``rollout_log_probs`` (vLLM's; only with ``--algo.advantage.is_correction_level``
other than ``off``), ``advantages``, ``rewards``, ``scores`` (the binary verifier score), ``truncated`` and
``index`` (the sample's position in the rollout: OpenRLHF's groups are ``index // n_samples_per_prompt``). The
PPO update returns scalars only (``actor_grad_norm``, ``entropy_loss``, ``vllm_kl``, ``is_filter_ratio``), so
ratio, ESS, clip split and the on-policy check are absent (docs/integrations.md).

Hooks: OpenRLHF's ``PPOTrainer`` is a Ray actor (``train_ppo_ray.py`` holds only its handle), so
:func:`monitored_ppo_trainer` returns a Ray actor class to launch in its place: the monitor lives in the trainer's
process. :func:`attach` wraps an instance's ``experience_maker.make_experience_batch`` and
``ppo_train(global_step)`` (``train_step`` calls both once per step). In async mode (``--train.async_enable``)
``PPOTrainerAsync`` only coordinates: the training runs in the ``TrainingActor`` it launches, which is where the
monitor goes; there a batch's old log-probs can come from newer weights than the ones that sampled it, so the
engine gap is not read. The optimizer steps run in the policy workers (``PolicyModelActor``):
:func:`monitored_policy_actor` hands each step's grad norm back with ``ppo_train``'s status.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from torch import Tensor

from grpo_exporter.config import AdvantageNorm
from grpo_exporter.ids import id_tensor
from grpo_exporter.integrations import (
    IntegrationError,
    carried_variables,
    carrying,
    observe_reported_update,
    observe_rollout_time_update,
    require,
    say_once,
)
from grpo_exporter.runtime.monitor import GRPOMonitor

TESTED = "openrlhf>=0.11,<0.12"

require("openrlhf", "openrlhf", TESTED)
from openrlhf.trainer.ppo_utils import Experience  # noqa: E402

#: OpenRLHF's logged status key → the sample here that means the same thing, and how they differ.
OPENRLHF_METRICS: Mapping[str, tuple[str, str]] = {
    "actor_grad_norm": ("grpo_grad_norm_pre_clip", "same (DeepSpeed's global norm), except OpenRLHF's 0.0 for a "
                        "norm DeepSpeed did not compute: absent here"),
    "entropy_loss": ("grpo_entropy_mean_nats", "same: token mean of the policy entropy (with --actor.entropy_coef)"),
    "vllm_kl": ('grpo_mismatch_kl_nats{estimator="k1"}',
                "same: masked mean of rollout - old log-probs (OpenRLHF's over each micro-batch's tokens, averaged)"),
    "is_filter_ratio": (
        'grpo_rollout_correction_capped_ratio{level="token"}',
        "token level, ratio gating, with rollout_correction_cap = the HIGH threshold: the share above it (OpenRLHF "
        "also counts the tokens below LOW)",
    ),
    "response_length": ("grpo_completion_length_tokens", "single turn: the same; multi-turn agents: OpenRLHF's spans "
                        "first to last action token (environment feedback included), here the model's tokens"),
}

#: ``--algo.advantage.estimator`` → the form of the advantages OpenRLHF computes with it
#: (``RemoteExperienceMaker.compute_advantages_and_returns``) while the KL penalty is not in the reward. Only
#: group_norm's z-score (torch.std: unbiased, eps 1e-9) and dr_grpo's r - mean_g keep a per-group |A| bound.
#: rloo subtracts the mean of the other G-1 rewards, G/(G-1) x (r - mean_g): group-centred, but a lone
#: failure gets the whole reward range, past the (G-1)/G x range of "none", and no whitening follows: "batch"
#: (group-centred, scaled by one batch-wide factor, no group bound). reinforce and reinforce_baseline are
#: whitened over the batch's action tokens afterwards (minus the mean; over the std unless
#: ``--algo.advantage.no_std_norm``); flash_reinforce subtracts the batch mean and divides by nothing: batch-
#: centred, "whitened". gae: per-token advantages from the critic's values, "shaped".
ESTIMATOR_FORMS: Mapping[str, AdvantageNorm] = {
    "group_norm": "unbiased",
    "dr_grpo": "none",
    "rloo": "batch",
    "reinforce": "whitened",
    "reinforce_baseline": "whitened",
    "flash_reinforce": "whitened",
    "gae": "shaped",
}

#: status keys (``STEP_GRAD_NORM`` + the optimizer step's index in the update) under which a
#: :func:`monitored_policy_actor` hands ``ppo_train`` each optimizer step's pre-clip norm: scalars, so a logger
#: that meets them (a trainer launched without :func:`monitored_ppo_trainer`) logs them instead of failing.
STEP_GRAD_NORM = "grpo_exporter/actor_grad_norm_step_"


def kl_in_reward(args: Any) -> bool:
    """Whether OpenRLHF puts the KL penalty in the reward: a reference model runs (``algo.kl.init_coef > 0``)
    and the KL is not a loss (``--algo.kl.use_loss``). Then every token's reward carries -coef x its KL
    (``compute_reward``), and each token's advantage the return of what is still to come."""
    kl = args.algo.kl
    return not bool(kl.use_loss) and _kl_coef(args) > 0


def advantage_form(args: Any) -> AdvantageNorm:
    """The form of the advantages OpenRLHF computes under ``args`` (the monitor's ``advantage_norm``):
    :data:`ESTIMATOR_FORMS` for ``algo.advantage.estimator``, "shaped" when the KL penalty is in the reward
    (:func:`kl_in_reward`, OpenRLHF's default: ``--algo.kl.init_coef`` 0.01 without ``--algo.kl.use_loss``):
    the per-token KL return moves each token's advantage off its sequence's, past any group bound. An
    estimator this adapter does not know raises :class:`IntegrationError` (a wrong form pages
    GRPOAdvantageAboveBound on a healthy run): pass ``advantage_norm=`` yourself."""
    estimator = str(args.algo.advantage.estimator)
    form = ESTIMATOR_FORMS.get(estimator)
    if form is None:
        raise IntegrationError(
            f"openrlhf: --algo.advantage.estimator {estimator!r} is not one this adapter knows "
            f"({', '.join(ESTIMATOR_FORMS)}; tested with {TESTED}): the form of its advantages is unknown. Pass "
            "advantage_norm= (docs/exporter.md) to monitored_ppo_trainer."
        )
    return "shaped" if kl_in_reward(args) else form


def is_async(args: Any) -> bool:
    """Whether OpenRLHF runs in async mode (``--train.async_enable``): a generator actor samples the next batches
    while the ``TrainingActor`` trains, and the weights reach vLLM between its steps."""
    return bool(getattr(getattr(args, "train", None), "async_enable", False))


def optimizer_steps_per_update(args: Any) -> int | None:
    """The optimizer steps one ``ppo_train`` takes: ``train.max_epochs`` x the rollout's samples
    (``rollout.batch_size`` x ``n_samples_per_prompt``) over ``train.batch_size``; None when unreadable."""
    try:
        samples = int(args.rollout.batch_size) * int(args.rollout.n_samples_per_prompt)
        return int(args.train.max_epochs) * max(samples // int(args.train.batch_size), 1)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def observe_experiences(
    monitor: GRPOMonitor, experiences: Sequence[Experience], step: int, *, correct_threshold: float = 0.5,
    engine: bool = True,
) -> None:
    """One :meth:`~GRPOMonitor.observe_rollout` for the step's experiences (concatenated with OpenRLHF's own
    ``Experience.concat_experiences``), and the rollout-time update inputs (advantages; the KL of the sampling
    policy to the reference). Groups are OpenRLHF's: ``index // group_size`` (its advantage reshapes the rewards
    by sample index, so two groups of one prompt text in a batch stay two groups); the prompt text, when there is
    no index. Prompts (for solve rates) are keyed by their text. Completion lengths are the model's tokens (a
    multi-turn ``response_length`` spans the environment's feedback too). ``scores >= correct_threshold`` is
    correct. The rewards go with the advantages too: the monitor tells their form (a batch whitening without a
    group baseline: affine in the reward) from the pair. ``engine=False``: the engine's log-probs are left out
    (async mode, where the old log-probs may come from newer weights than the ones that sampled)."""
    with monitor.contained("rollout", "openrlhf observe_experiences"):
        batch = Experience.concat_experiences(list(experiences), pad_token_id=0)
        mask: Tensor = batch.action_mask.bool()
        width = mask.shape[1]
        rollout: dict[str, Any] = {
            "loss_mask": mask,
            "completion_ids": batch.sequences[:, -width:],
            "completion_mask": mask,
            "completion_lengths": mask.sum(dim=1),
            "old_logprobs": batch.action_log_probs,
            "rollout_logprobs": batch.rollout_log_probs if engine else None,
        }
        if batch.rewards is not None:
            rollout["rewards"] = batch.rewards.float().reshape(-1)
        if batch.scores is not None:
            rollout["correct"] = batch.scores.float().reshape(-1) >= correct_threshold
        if batch.truncated is not None:
            rollout["truncated"] = batch.truncated.bool().reshape(-1)
        index = list(batch.index) if batch.index is not None else []
        if len(index) == mask.shape[0]:
            rollout["group_ids"] = [int(i) // monitor.config.group_size for i in index]
        elif batch.prompts:
            rollout["group_ids"] = list(batch.prompts)
        if batch.prompts:
            rollout["prompt_ids"] = list(batch.prompts)
        monitor.observe_rollout(step, **rollout)
        groups = rollout.get("group_ids")
        more = {} if groups is None else {"group_ids": id_tensor("group_ids", groups, mask.device)}
        if "rewards" in rollout:  # the form check reads the advantages against the rewards they came from
            more["rewards"] = rollout["rewards"]
        observe_rollout_time_update(monitor, step, mask, batch.advantages, batch.action_log_probs,
                                    batch.base_action_log_probs, more=more)


def pop_step_grad_norms(status: MutableMapping[str, Any]) -> list[float] | None:
    """Take the per-optimizer-step norms a :func:`monitored_policy_actor` put in ``ppo_train``'s status out of
    it (in step order; the status goes on to OpenRLHF's loggers without them); None when there are none."""
    keys = [k for k in status if isinstance(k, str) and k.startswith(STEP_GRAD_NORM)]
    keys.sort(key=lambda k: int(k[len(STEP_GRAD_NORM):]))
    return [float(status.pop(k)) for k in keys] or None


def _norm_reading(monitor: GRPOMonitor, norm: Any) -> float | None:
    """A pre-clip norm as published: OpenRLHF's 0.0 (``get_grad_norm``'s value when DeepSpeed computed none)
    is no reading, said once, never a norm of 0."""
    if norm is None:
        return None
    if float(norm) == 0.0:
        say_once(monitor, "openrlhf-zero-norm", "grpo_exporter: OpenRLHF reports actor_grad_norm 0.0, its value "
                 "when DeepSpeed computed no norm: no grad-norm reading is published for such steps")
        return None
    return float(norm)


def observe_status(
    monitor: GRPOMonitor, step: int, status: Mapping[str, Any], max_grad_norm: float | None = None,
    step_norms: Sequence[float] | None = None,
) -> None:
    """The update side from ``ppo_train``'s status, then end the step. ``step_norms``: each optimizer step's
    pre-clip norm (:func:`monitored_policy_actor`), each published as its own optimizer step (the monitor's
    step number stays ``step``: ``grpo_optimizer_steps_total`` and the clip and spike counts count each).
    Without them, ``actor_grad_norm``, one optimizer step: ``ActorPPOTrainer.ppo_train`` keeps the value of its
    last micro-batch, the norm DeepSpeed cached at the last optimizer step. ``entropy_loss`` (the token mean of
    the policy entropy over the whole update, when an entropy coefficient is set) goes with the last."""
    with monitor.contained("update", "openrlhf observe_status"):
        given: Sequence[Any] = step_norms or [status.get("actor_grad_norm")]
        norms = [_norm_reading(monitor, g) for g in given]
        for norm in norms[:-1]:
            if norm is not None:
                observe_reported_update(monitor, step, norm, None, max_grad_norm)
        entropy = status.get("entropy_loss")
        observe_reported_update(monitor, step, norms[-1], None if entropy is None else float(entropy), max_grad_norm)


def attach(trainer: Any, monitor: GRPOMonitor, max_grad_norm: float | None = None) -> None:
    """Report every ``train_step`` of an OpenRLHF PPO trainer instance to ``monitor``: wraps its
    ``experience_maker.make_experience_batch`` (the experiences are held) and ``ppo_train(global_step)``, which
    observes them at ``global_step`` before the update and the status after it (with the per-optimizer-step
    norms of a :func:`monitored_policy_actor`, taken out of the status it returns). In async mode
    (:func:`is_async`) the engine's log-probs are not read (said once)."""
    maker = trainer.experience_maker
    make, train = maker.make_experience_batch, trainer.ppo_train
    held: list[Sequence[Experience]] = []
    args = getattr(trainer, "args", None)
    steps = optimizer_steps_per_update(args)
    fresh = not is_async(args)
    if not fresh:
        say_once(monitor, "openrlhf-async-engine", "grpo_exporter: OpenRLHF async (--train.async_enable) samples a "
                 "batch with the weights vLLM holds then and computes its old log-probs with the trainer's weights "
                 "when it trains on it, which can be newer (OpenRLHF tags no policy version): their difference "
                 "would be the policy lag, so no engine log-prob gap is published")

    def make_experience_batch(*args: Any, **kwargs: Any) -> Any:
        experiences = make(*args, **kwargs)
        held[:] = [experiences]
        return experiences

    def ppo_train(global_step: int, *args: Any, **kwargs: Any) -> Any:
        if held:
            observe_experiences(monitor, held.pop(), int(global_step), engine=fresh)
        status = train(global_step, *args, **kwargs)
        norms = pop_step_grad_norms(status) if isinstance(status, MutableMapping) else None
        if norms is None and (steps or 0) > 1 and isinstance(status, Mapping) and "actor_grad_norm" in status:
            say_once(monitor, "openrlhf-last-norm", f"grpo_exporter: OpenRLHF takes {steps} optimizer steps per "
                     "update and reports the last one's grad norm: one norm per step is published. Launch the "
                     "actor group with monitored_policy_actor() for every optimizer step's norm")
        observe_status(monitor, int(global_step), status, max_grad_norm, norms)
        return status

    maker.make_experience_batch = make_experience_batch
    trainer.ppo_train = ppo_train


def _kl_coef(args: Any) -> float:
    """The KL-to-reference coefficient OpenRLHF starts from: ``algo.kl.init_coef`` (in the loss with
    ``--algo.kl.use_loss``, else in the reward; 0 is no penalty). An adaptive controller (``algo.kl.target``)
    moves it from there: the rules read whether a penalty is on, not its value."""
    kl = getattr(getattr(args, "algo", None), "kl", None)
    return float(getattr(kl, "init_coef", 0.0) or 0.0)


def _actor_class(base: Any, cls: type) -> Any:
    """``cls`` as a Ray actor class with ``base``'s default options (``PolicyModelActor``'s ``num_gpus=1``)."""
    import ray

    options = dict(getattr(base, "_default_options", None) or {})
    return ray.remote(**options)(cls) if options else ray.remote(cls)


def _launches_training_actor(cls: Any) -> bool:
    """Whether ``cls`` is OpenRLHF's async coordinator: its ``__init__`` launches the ``TrainingActor`` of its
    module (``PPOTrainerAsync``), the actor that trains."""
    init = getattr(cls, "__init__", None)
    code = getattr(init, "__code__", None)
    return code is not None and "TrainingActor" in code.co_names and "TrainingActor" in getattr(init, "__globals__", {})


def _monitored_trainer(cls: Any, max_grad_norm: float | None, monitor_settings: Mapping[str, Any],
                       carried: Mapping[str, str]) -> Any:
    """``cls`` (a ``BasePPOTrainer``) making and attaching a monitor after its own ``__init__``, with the
    ``carried`` variables where its process has none of its own."""

    class MonitoredPPOTrainer(cls):
        monitor: GRPOMonitor

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            missing = [name for name in ("args", "experience_maker", "ppo_train") if not hasattr(self, name)]
            if missing:
                raise IntegrationError(
                    f"openrlhf: {cls.__name__} has no {', '.join(missing)} after its __init__: it is not a trainer "
                    "whose train_step the monitor can follow (BasePPOTrainer's make_experience_batch and ppo_train). "
                    f"Pass OpenRLHF's PPOTrainer or PPOTrainerAsync as base. Tested with {TESTED}."
                )
            settings: dict[str, Any] = {"group_size": int(self.args.rollout.n_samples_per_prompt),
                                        "kl_coef": _kl_coef(self.args)}
            if "advantage_norm" not in monitor_settings:
                settings["advantage_norm"] = advantage_form(self.args)
            with carrying(carried):
                self.monitor = GRPOMonitor(**{**settings, **monitor_settings})
            clip = max_grad_norm if max_grad_norm is not None else float(self.args.actor.max_norm)
            attach(self, self.monitor, max_grad_norm=clip if clip > 0 else None)

    return MonitoredPPOTrainer


def _monitored_coordinator(cls: Any, monitored: Callable[[Any], Any]) -> Any:
    """``cls`` (``PPOTrainerAsync``) launching ``monitored(TrainingActor)`` where it launches OpenRLHF's
    ``TrainingActor``: the name is rebound, for the coordinator's ``__init__`` only, in the globals that
    ``__init__`` reads, taken when it runs (Ray ships the class to the coordinator's own process by value, with
    globals of its own; no other code of that process runs meanwhile)."""

    class MonitoredPPOTrainerAsync(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            namespace: dict[str, Any] = cls.__init__.__globals__
            inner = namespace["TrainingActor"]
            namespace["TrainingActor"] = monitored(inner)
            try:
                super().__init__(*args, **kwargs)
            finally:
                namespace["TrainingActor"] = inner

    return MonitoredPPOTrainerAsync


def monitored_ppo_trainer(base: Any = None, *, max_grad_norm: float | None = None,
                          **monitor_settings: Any) -> Any:
    """A Ray actor class to launch in place of OpenRLHF's ``PPOTrainer`` (``MonitoredPPOTrainer.remote(...)``
    with the same arguments, e.g. in a copy of ``train_ppo_ray.py``): the trainer's own class (the one under
    ``@ray.remote``), which makes a :class:`GRPOMonitor` in the trainer's process after OpenRLHF's ``__init__``
    (``group_size`` from ``rollout.n_samples_per_prompt``, ``kl_coef`` from ``algo.kl.init_coef``,
    ``advantage_norm`` from the estimator and where the KL penalty sits (:func:`advantage_form`), ``run`` from
    ``monitor_settings`` or the environment; a setting in ``monitor_settings`` wins) and :func:`attach` es it,
    with the clip line ``actor.max_norm`` unless ``max_grad_norm`` is given (0: DeepSpeed does not clip).

    ``base``: OpenRLHF's ``PPOTrainer`` (default), a Ray actor class or a plain class (a plain class comes back
    plain). ``PPOTrainerAsync`` (``--train.async_enable``) holds no trainer state (no ``args``, no experience
    maker, no ``ppo_train``): it launches a generator and a ``TrainingActor``, and the monitored coordinator
    launches the monitored ``TrainingActor`` in its place, so the monitor lives in the training actor's process.
    OpenRLHF tags no rollout with the policy version that generated it: in async mode no staleness is read, and
    no engine gap (:func:`attach`). A class that has no trainer state after its ``__init__`` raises
    :class:`IntegrationError` there.

    Ray places the trainer (or the training actor) on a node of its choice: ``targets_dir=`` (a directory
    Prometheus reads with ``file_sd_configs``) has its monitor announce the address and port it serves there.
    ``monitor_settings`` travel with the class (Ray ships it by value, and the coordinator the training actor's),
    and so do the ``GRPO_EXPORTER_*`` variables of the process that calls this (but ``GRPO_EXPORTER_HOST`` and
    ``GRPO_EXPORTER_ADVERTISE_HOST``, which name this node), under the actor's own
    (:func:`~grpo_exporter.integrations.carrying`)."""
    if base is None:
        base = require("openrlhf.trainer.ppo_trainer", "openrlhf", TESTED).PPOTrainer
    cls = getattr(base, "__ray_actor_class__", base)
    carried = carried_variables()
    if _launches_training_actor(cls):
        def training_actor(inner: Any) -> Any:  # in the coordinator's process: the variables go on with the class
            with carrying(carried):
                return monitored_ppo_trainer(inner, max_grad_norm=max_grad_norm, **monitor_settings)

        monitored = _monitored_coordinator(cls, training_actor)
    else:
        monitored = _monitored_trainer(cls, max_grad_norm, monitor_settings, carried)
    monitored.__name__ = monitored.__qualname__ = f"Monitored{cls.__name__}"
    return monitored if cls is base else _actor_class(base, monitored)


def record_step_grad_norms(trainer: Any) -> list[float]:
    """Wrap an ``ActorPPOTrainer``'s ``training_step`` (one micro-batch): the list it returns gets the
    ``actor_grad_norm`` of each call in which DeepSpeed took an optimizer step (its engine's ``global_steps``
    moved; ``training_step`` reads the norm after ``optimizer_step`` on every micro-batch, where DeepSpeed
    repeats its cached norm between boundaries)."""
    norms: list[float] = []
    step = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        engine = getattr(trainer.actor, "model", None)
        before = getattr(engine, "global_steps", None)
        status = step(*args, **kwargs)
        norm = status.get("metrics", {}).get("actor_grad_norm") if isinstance(status, Mapping) else None
        if before is not None and getattr(engine, "global_steps", before) != before and norm is not None:
            norms.append(float(norm))
        return status

    trainer.training_step = training_step
    return norms


def monitored_policy_actor(base: Any = None) -> Any:
    """A Ray actor class to launch the policy's actor group with in place of OpenRLHF's ``PolicyModelActor``
    (``RayActorGroup(..., monitored_policy_actor(), ...)`` in a copy of ``train_ppo_ray.py``): its ``fit``
    returns OpenRLHF's status plus each optimizer step's pre-clip norm (:data:`STEP_GRAD_NORM` keys), which a
    :func:`monitored_ppo_trainer` takes out and publishes one optimizer step each. OpenRLHF's own status keeps
    the last one only. ``base``: ``PolicyModelActor`` (default), a Ray actor class or a plain class."""
    if base is None:
        base = require("openrlhf.trainer.ray.ppo_actor", "openrlhf", TESTED).PolicyModelActor
    cls = getattr(base, "__ray_actor_class__", base)

    class MonitoredPolicyModelActor(cls):  # type: ignore[misc, valid-type]
        step_grad_norms: list[float] | None = None

        def init_model_from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
            result = super().init_model_from_pretrained(*args, **kwargs)
            self.step_grad_norms = record_step_grad_norms(self.trainer)
            return result

        def fit(self, *args: Any, **kwargs: Any) -> Any:
            norms = self.step_grad_norms
            if norms is None:
                return super().fit(*args, **kwargs)
            norms.clear()
            status = super().fit(*args, **kwargs)
            return {**status, **{f"{STEP_GRAD_NORM}{i}": norm for i, norm in enumerate(norms)}}

    MonitoredPolicyModelActor.__name__ = MonitoredPolicyModelActor.__qualname__ = f"Monitored{cls.__name__}"
    return MonitoredPolicyModelActor if cls is base else _actor_class(base, MonitoredPolicyModelActor)
