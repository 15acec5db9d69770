"""Bad input: a clear error naming the field, what was expected and what came."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.step import compute_step

N, T = 8, 5


def ok(**kw):
    base = {"rewards": torch.zeros(N), "loss_mask": torch.ones(N, T, dtype=torch.bool), "logprobs": torch.zeros(N, T)}
    base.update(kw)
    return base


@pytest.mark.parametrize(
    ("kwargs", "field", "expected", "received"),
    [
        (ok(old_logprobs=torch.zeros(N, T - 1)), "old_logprobs", "T=5 like `logprobs`", "(8, 4)"),
        (ok(old_logprobs=torch.zeros(N + 1, T)), "old_logprobs", "N=8 rows like `rewards`", "(9, 5)"),
        (ok(rewards=torch.zeros(N, 1)), "rewards", "shape (N,)", "(8, 1)"),
        (ok(logprobs=torch.zeros(N, T, dtype=torch.int64)), "logprobs", "floating-point", "torch.int64"),
        (ok(completion_lengths=torch.ones(N)), "completion_lengths", "an integer tensor", "torch.float32"),
        (ok(entropy=[[0.0] * T] * N), "entropy", "a torch.Tensor", "list"),
        (ok(on_policy=1), "on_policy", "a Python bool", "int 1"),
        (ok(grad_norm_pre_clip=torch.ones(2)), "grad_norm_pre_clip", "one-element tensor", "(2,)"),
        (ok(reward_components={"total": torch.zeros(N)}), "reward_components", "other than 'total'", "'total'"),
        (ok(reward_components={"fmt": torch.zeros(N - 1)}), "reward_components['fmt']", "N=8", "(7,)"),
        (ok(params_before=[torch.ones(2)]), "params_after", "together", "only one"),
        (ok(params_before=[torch.ones(2)], params_after=[torch.ones(3)]), "params_after", "(2,)", "(3,)"),
        (ok(old_logprobs=torch.zeros(N, T, device="meta")), "old_logprobs", "device cpu", "device meta"),
        (ok(policy_version=1.5), "policy_version", "a Python int", "float"),
    ],
)
def test_error_names_field_expected_and_received(kwargs, field, expected, received):
    with pytest.raises(InputError) as err:
        StepInputs(**kwargs)
    assert err.value.field == field
    assert expected in err.value.expected
    assert received in err.value.received
    assert str(err.value).startswith(f"`{field}`: expected ")


def test_group_size_must_divide_n_without_group_ids():
    with pytest.raises(InputError, match=r"`group_ids`: expected .*group_size=3.* got N=8"):
        compute_step(StepInputs(**ok()), MetricsConfig(group_size=3))
    compute_step(StepInputs(**ok(group_ids=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]))), MetricsConfig(group_size=3))


def test_masks_are_normalised_to_bool():
    x = StepInputs(**ok(loss_mask=torch.ones(N, T, dtype=torch.int64), correct=torch.ones(N)))
    assert x.loss_mask.dtype == torch.bool
    assert x.correct.dtype == torch.bool


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="pass_k"):
        MetricsConfig(group_size=4, pass_k=(8,))
    with pytest.raises(ValueError, match="clip_eps_low"):
        MetricsConfig(group_size=4, clip_eps_low=1.5)
    with pytest.raises(ValueError, match="group_size"):
        MetricsConfig(group_size=0)
    with pytest.raises(ValueError, match="gap_quantiles"):
        MetricsConfig(group_size=4, gap_quantiles=(0.9, 0.5))


def test_replaced_swaps_fields_without_touching_the_original():
    """``replaced`` (a detached copy, the monitor's own prediction) keeps everything validation set and leaves
    the original as it was."""
    logprobs = torch.zeros(2, 3, requires_grad=True) - 1.0
    x = StepInputs(rewards=torch.ones(2), logprobs=logprobs, loss_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))
    detached = x.replaced(logprobs=x.logprobs.detach(), zero_variance_prob=torch.full((2,), 0.5, dtype=torch.float64))
    assert x.logprobs.requires_grad
    assert x.zero_variance_prob is None
    assert not detached.logprobs.requires_grad
    assert detached.zero_variance_prob is not None
    assert detached.zero_variance_prob.tolist() == [0.5, 0.5]
    assert (detached.n, detached.device) == (2, x.device)
    assert detached.loss_mask is x.loss_mask
    assert detached.loss_mask.dtype == torch.bool  # the validated (normalised) mask, not the 0/1 ints given


def test_groups_are_built_once_and_shared_with_replaced_copies():
    """The grouping (and what it remembers: counts of outcomes) is built once per group size; a ``replaced``
    copy shares it unless the group ids change; a grouping error raises on every call."""
    x = StepInputs(rewards=torch.ones(4), correct=torch.tensor([True, False, True, True]))
    groups = x.groups(2)
    assert x.groups(2) is groups
    assert x.replaced(zero_variance_prob=torch.zeros(4, dtype=torch.float64)).groups(2) is groups
    assert x.groups(4) is not groups
    assert x.groups(4).bins == 1
    regrouped = x.replaced(group_ids=torch.tensor([0, 1, 1, 0]))
    assert regrouped.groups(4).index.tolist() == [0, 1, 1, 0]
    for _ in range(2):
        with pytest.raises(InputError, match="group_ids"):
            x.groups(3)


def test_one_field_table_describes_every_input():
    """inputs.FIELDS is the one table of StepInputs' fields: validation, the micro-step stitching and the
    keywords observe_update takes are read from it, so a field added to StepInputs without a row fails here."""
    import dataclasses

    from grpo_exporter.inputs import FIELDS
    from grpo_exporter.runtime.monitor import UPDATE_FIELDS
    from grpo_exporter.stitching import PASSED_THROUGH, PER_ROW

    assert sorted(FIELDS) == sorted(f.name for f in dataclasses.fields(StepInputs))
    per_row = {n for n, s in FIELDS.items() if s.axis in ("row", "token", "row or token")}
    rollout_only = {"zero_variance_prob", "all_incorrect_prob",  # the monitor's own predictions, per rollout
                    "turns", "partial"}  # what a multi-turn or asynchronous loop counts, per rollout
    assert set(PER_ROW) == per_row - rollout_only
    assert {n for n in per_row if not FIELDS[n].update} == rollout_only
    assert "grad_norm_pre_clip" in PASSED_THROUGH
    assert "step" not in UPDATE_FIELDS
    assert "reward_components" not in UPDATE_FIELDS


def test_the_observe_calls_keywords_are_typed_as_the_table_says():
    """keywords.RolloutFields/UpdateFields (what a type checker sees) hold exactly the fields the table gives each
    call, typed as StepInputs types them (the rollout's group ids may also be strings: hashed before)."""
    from grpo_exporter.inputs import FIELDS
    from grpo_exporter.keywords import ACCEPTED, TYPED

    declared = StepInputs.__annotations__
    for call, typed in TYPED.items():
        assert set(typed.__annotations__) == ACCEPTED[call], call
        assert ACCEPTED[call] == {n for n, s in FIELDS.items() if getattr(s, call.removeprefix("observe_"))}
        for name, annotation in typed.__annotations__.items():
            expected = declared[name]
            if name == "group_ids" and call == "observe_rollout":
                expected = "Tensor | Sequence[Any] | None"
            if name == "reward_components":
                expected = "Mapping[str, Tensor] | None"  # None reads as none given
            assert getattr(annotation, "__forward_arg__", annotation) == expected, (call, name)
