"""The validated container of one step's inputs.

N completions = P prompts x G samples; T = padded completion length (position t of a row is the t-th
completion token). Every field is optional: a metric whose inputs are missing is simply not computed.
Validation reads only shapes, dtypes and devices, so it never synchronises with an accelerator; a wrong
field raises :class:`InputError` naming the field, what was expected and what came.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.catalog import check_label_value
from grpo_exporter.functional.groups import Groups, contiguous_groups, groups_from_ids
from grpo_exporter.input_fields import (
    COUNTS,
    FIELDS,
    INTEGERS,
    MAX_COUNT,
    MAX_INTEGER,
    MAX_ROW_COUNT,
    SCALARS,
    fields_where,
)
from grpo_exporter.input_fields import SEQUENCE_BOOLS as SEQUENCE_BOOLS
from grpo_exporter.input_fields import SEQUENCE_FLOATS as SEQUENCE_FLOATS
from grpo_exporter.input_fields import TOKEN_BOOLS as TOKEN_BOOLS
from grpo_exporter.input_fields import TOKEN_FLOATS as TOKEN_FLOATS


class InputError(ValueError):
    """A step input with the wrong shape, dtype, device or type."""

    def __init__(self, name: str, expected: str, received: str) -> None:
        self.field, self.expected, self.received = name, expected, received
        super().__init__(f"`{name}`: expected {expected}, got {received}")


def check_count(name: str, value: Any, what: str = "a count", largest: int = MAX_COUNT) -> None:
    """None, or a Python int in 0..``largest`` (a count a framework kept on the host, a step, a version); else
    :class:`InputError` naming ``name``."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= largest):
        raise InputError(name, f"a Python int in 0..{largest} ({what})", describe(value))


def describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)}, dtype {value.dtype}, device {value.device}"
    return f"{type(value).__name__} {value!r}"[:120]


def not_binary(value: Tensor) -> Tensor:
    """How many entries of a numeric ``value`` are neither 0 nor 1 (NaN included), counted on its device: the rule
    of every boolean input (a bool tensor, or numbers holding only 0 and 1)."""
    return ((value != 0) & (value != 1)).sum()


def check_step(step: int) -> None:
    """A step number in 0..:data:`MAX_INTEGER`; else :class:`InputError` naming ``step`` (counted in the call: a
    step beyond any run's reach never becomes the run's step)."""
    check_count("step", step, "a step number", MAX_INTEGER)


def out_of_range(value: Tensor, largest: int = MAX_ROW_COUNT) -> Tensor:
    """How many entries of an integer ``value`` lie outside 0..``largest``, counted on its device: the rule of
    every per-completion count (a negative length or a staleness past fp32's integers cannot be true). Only the
    bounds its dtype can cross are compared (``largest`` does not fit an int8: comparing would wrap it)."""
    info = torch.iinfo(value.dtype)
    outside = [value < 0] if info.min < 0 else []
    if info.max > largest:
        outside.append(value > largest)
    if not outside:
        return torch.zeros((), dtype=torch.int64, device=value.device)
    return (outside[0] | outside[1]).sum() if len(outside) == 2 else outside[0].sum()


#: what a value check of each kind expects, and what its count of bad values is (the error after the transfer)
_VALUE_RULES = {
    "bool": ("a bool tensor, or 0/1 values", "{bad:g} values other than 0 and 1"),
    "count": (f"integers in 0..{MAX_ROW_COUNT} (a count per completion)", "{bad:g} values outside that range"),
    "norm": ("a number >= 0 (a norm)", "a negative one"),
    "kept": ("at least the groups kept in the batch", "{bad:g} groups kept"),
}


def value_error(failed: Sequence[tuple[str, float]]) -> InputError:
    """The one error of a call whose value checks failed (read after the step's one transfer): the first
    field's, naming the others (one rejected call is one error, however many of its fields were wrong)."""
    name, bad = failed[0]
    spec = FIELDS.get(name)
    rule = "kept" if name == "generated_groups" else spec.kind if spec is not None and spec.kind in _VALUE_RULES \
        else "bool"
    expected, received = _VALUE_RULES[rule]
    others = sorted({other for other, _ in failed[1:]} - {name})
    also = f"; also wrong: {', '.join(f'`{other}`' for other in others)}" if others else ""
    return InputError(name, expected, received.format(bad=bad) + also)


@dataclass(frozen=True)
class StepInputs:
    """One step's tensors and scalars. Construct with keywords; ``__post_init__`` validates and normalises.

    Boolean fields (masks, ``correct``, ``truncated``) accept bool tensors, or integer/float tensors holding
    only 0 and 1, and are stored as bool. Checking the values of a numeric mask would need a host sync, so
    the count of other values is kept on the device in ``value_errors`` and read with the step's one
    transfer: a mask of 0.5 is then an error naming the field, never True. ``on_policy`` is a bool, or a
    (N,) bool tensor flagging the on-policy rows (micro-steps stitched into one step)."""

    rewards: Tensor | None = None
    group_ids: Tensor | None = None
    correct: Tensor | None = None
    truncated: Tensor | None = None
    reward_components: Mapping[str, Tensor] = field(default_factory=dict)
    zero_variance_prob: Tensor | None = None
    all_incorrect_prob: Tensor | None = None
    completion_lengths: Tensor | None = None
    turns: Tensor | None = None
    partial: Tensor | None = None
    staleness: Tensor | None = None
    completion_mask: Tensor | None = None
    tool_mask: Tensor | None = None
    completion_ids: Tensor | None = None
    loss_mask: Tensor | None = None
    logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    advantages: Tensor | None = None
    routed_experts: Tensor | None = None
    rollout_routed_experts: Tensor | None = None
    routing_replay: bool | None = None
    on_policy: bool | Tensor | None = None
    grads: Sequence[Tensor] | None = None
    grad_norm_pre_clip: Tensor | float | None = None
    grad_norm_post_clip: Tensor | float | None = None
    max_grad_norm: Tensor | float | None = None
    params_before: Sequence[Tensor] | None = None
    params_after: Sequence[Tensor] | None = None
    loss: Tensor | float | None = None
    entropy_mean: Tensor | float | None = None
    policy_version: int | None = None
    rollout_policy_version: int | None = None
    step: int | None = None
    tool_calls: int | None = None
    tool_failures: int | None = None
    aborted_completions: int | None = None
    generated_groups: int | None = None
    filtered_all_correct_groups: int | None = None
    filtered_all_incorrect_groups: int | None = None
    value_errors: tuple[tuple[str, Tensor], ...] = ()

    def __post_init__(self) -> None:
        check = _Validator(self)
        check.per_row("row")
        check.components()
        check.per_row("token")
        check.advantages()
        check.experts()
        check.on_policy()
        check.scalars()
        check.parameters()
        object.__setattr__(self, "value_errors", tuple(check.value_errors))
        object.__setattr__(self, "_n", check.shape.n)
        object.__setattr__(self, "_device", check.device[0][1] if check.device else torch.device("cpu"))

    def replaced(self, **changes: Tensor) -> StepInputs:
        """A copy with tensor fields replaced by tensors of the same shape, dtype and device as validation would
        accept (a detached copy of a field, the monitor's own per-sample prediction): not validated again (a
        validation on every micro-batch whose log-probs need grad would be paid twice)."""
        copy = object.__new__(StepInputs)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        if "group_ids" in changes:
            copy.__dict__.pop("_groups", None)
        return copy

    @property
    def n(self) -> int | None:
        """Number of completions N, when any per-completion field was given."""
        return self._n  # type: ignore[attr-defined]

    @property
    def empty(self) -> bool:
        """No completion (N = 0): nothing to measure (the step's metrics are skipped). T = 0 tokens is measured:
        the per-completion values (rewards, groups) stand, the per-token readings are absent."""
        return self._n == 0  # type: ignore[attr-defined]

    @property
    def device(self) -> torch.device:
        """Device of the tensors (cpu when none was given)."""
        return self._device  # type: ignore[attr-defined]

    def groups(self, group_size: int) -> Groups | None:
        """Prompt groups: from ``group_ids`` when given, else contiguous blocks of ``group_size``. Built once per
        ``group_size`` and shared by every reader of these inputs and of their :meth:`replaced` copies (the
        monitor's solve-rate prediction and the stage's blocks count the same outcomes once)."""
        if self.n is None:
            return None
        known = self.__dict__.get("_groups")
        if known is not None and known[0] == group_size:
            return known[1]
        if self.group_ids is not None:
            made = groups_from_ids(self.group_ids)
        elif self.n % group_size:
            raise InputError(
                "group_ids",
                f"group_ids, or N divisible by group_size={group_size} for contiguous groups",
                f"N={self.n} and no group_ids",
            )
        else:
            made = contiguous_groups(self.n, group_size, self.device)
        self.__dict__["_groups"] = (group_size, made)
        return made

    def given(self) -> tuple[str, ...]:
        """Names of the fields that were provided."""
        return tuple(
            f.name
            for f in fields(self)
            if f.name != "value_errors" and getattr(self, f.name) is not None
            and (f.name != "reward_components" or self.reward_components)
        )


class _Validator:
    """The validation of one :class:`StepInputs`, field kind by field kind (:data:`FIELDS`): shapes against the
    N and T the first fields set, one device for every tensor, dtypes; normalised values are written back."""

    def __init__(self, inputs: StepInputs) -> None:
        self.x = inputs
        self.shape = _Shape()
        self.device: list[tuple[str, torch.device]] = []
        self.value_errors = list(inputs.value_errors)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self.x, name, value)

    def tensor(self, name: str, value: Any) -> Tensor:
        if not isinstance(value, Tensor):
            raise InputError(name, "a torch.Tensor", describe(value))
        if self.device and value.device != self.device[0][1]:
            raise InputError(name, f"device {self.device[0][1]} like `{self.device[0][0]}`", describe(value))
        self.device.append((name, value.device))
        return value

    def as_bool(self, name: str, value: Tensor) -> Tensor:
        """A bool tensor; a numeric one holding other values than 0 and 1 is counted on the device (read with the
        step's one transfer: checking the values here would need a host sync)."""
        if value.dtype == torch.bool:
            return value
        if value.is_complex():
            raise InputError(name, "a bool tensor, or 0/1 values", describe(value))
        self.value_errors.append((name, not_binary(value)))
        return value != 0

    def per_row(self, axis: str) -> None:
        """The (N,) fields (``axis="row"``) or the (N, T) ones (``"token"``)."""
        for name in fields_where(axis):
            value, spec = getattr(self.x, name), FIELDS[name]
            if value is None:
                continue
            (self.shape.sequence if axis == "row" else self.shape.tokens)(name, self.tensor(name, value))
            if spec.kind == "float":
                _floating(name, value)
            elif spec.kind == "bool":
                self._set(name, self.as_bool(name, value))
            elif value.is_floating_point() or value.dtype == torch.bool or value.is_complex():
                raise InputError(name, spec.what or f"an integer tensor of counts in 0..{MAX_ROW_COUNT}",
                                 describe(value))
            elif spec.kind == "count" and all(checked != name for checked, _ in self.value_errors):
                self.value_errors.append((name, out_of_range(value)))  # once: stitched micro-steps carry theirs

    def components(self) -> None:
        if not isinstance(self.x.reward_components, Mapping):
            raise InputError("reward_components", "a mapping of name -> (N,) tensor",
                             describe(self.x.reward_components))
        components = dict(self.x.reward_components)
        for key, value in components.items():
            name = f"reward_components[{str(key)[:40]!r}]"
            if key == "total" or key == "":
                raise InputError("reward_components", "non-empty names other than 'total' (the summed reward)",
                                 repr(key))
            try:
                check_label_value("component", key)
            except ValueError as exc:
                raise InputError("reward_components", "names usable as a label value", str(exc)) from None
            self.shape.sequence(name, self.tensor(name, value))
            _floating(name, value)
        self._set("reward_components", components)

    def advantages(self) -> None:
        """Per sequence (N,) or per token (N, T)."""
        if self.x.advantages is not None:
            adv = self.tensor("advantages", self.x.advantages)
            _floating("advantages", adv)
            if adv.dim() == 1:
                self.shape.sequence("advantages", adv)
            else:
                self.shape.tokens("advantages", adv)

    def experts(self) -> None:
        """The routed experts of both sides, (N, T, L, k) integer ids on the rows and positions of the token
        fields, the same L and k on both; ``routing_replay`` a bool."""
        layers: tuple[str, tuple[int, ...]] | None = None
        for name in fields_where("experts"):
            value = getattr(self.x, name)
            if value is None:
                continue
            ids = self.tensor(name, value)
            if (ids.dim() != 4 or ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex()
                    or not ids.shape[2] or not ids.shape[3]):
                raise InputError(name, "an integer tensor of shape (N, T, layers, k), layers and k at least 1: the k "
                                 "experts each token was routed to in each MoE layer", describe(ids))
            self.shape.tokens(name, ids, per_token=True)
            if layers is None:
                layers = (name, tuple(ids.shape[2:]))
            elif tuple(ids.shape[2:]) != layers[1]:
                raise InputError(name, f"(layers, k) = {layers[1]} like `{layers[0]}`", describe(ids))
        replay = self.x.routing_replay
        if replay is not None and not isinstance(replay, bool):
            raise InputError("routing_replay", "a Python bool (the trainer replays the engine's routing)",
                             describe(replay))

    def on_policy(self) -> None:
        flag = self.x.on_policy
        if isinstance(flag, Tensor):
            if flag.dtype != torch.bool:
                raise InputError("on_policy", "a Python bool or a (N,) bool tensor", describe(flag))
            self.shape.sequence("on_policy", self.tensor("on_policy", flag))
        elif flag is not None and not isinstance(flag, bool):
            raise InputError("on_policy", "a Python bool or a (N,) bool tensor", describe(flag))

    def scalars(self) -> None:
        """Numbers (a Python number or a one-element tensor, kept 0-d on its device) and Python ints."""
        for name in SCALARS:
            value, norm = getattr(self.x, name), FIELDS[name].kind == "norm"
            if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
                if norm and value is not None and value < 0:  # NaN passes: a non-finite norm is the guard's
                    raise InputError(name, "a number >= 0 (a norm)", describe(value))
                continue
            if not isinstance(value, Tensor) or value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
                raise InputError(name, "a number or a one-element tensor (not bool or complex)", describe(value))
            self._set(name, self.tensor(name, value).reshape(()))
            if norm and all(checked != name for checked, _ in self.value_errors):
                self.value_errors.append((name, (value < 0).sum()))
        for name in INTEGERS:
            check_count(name, getattr(self.x, name), "a step or policy version", MAX_INTEGER)
        learner, actor = self.x.policy_version, self.x.rollout_policy_version
        if learner is not None and actor is not None and learner < actor:
            raise InputError("policy_version", f"at least rollout_policy_version ({actor}): the weights updated are "
                             "never older than the ones that generated", describe(learner))
        for name in COUNTS:
            check_count(name, getattr(self.x, name))
        calls, failures = self.x.tool_calls, self.x.tool_failures
        if failures is not None and calls is not None and failures > calls:
            raise InputError("tool_failures", f"at most tool_calls ({calls})", describe(failures))
        generated = self.x.generated_groups
        for name in ("filtered_all_correct_groups", "filtered_all_incorrect_groups"):
            if getattr(self.x, name) is not None and generated is None:
                raise InputError(name, "generated_groups beside it (the groups the filter saw)", "none given")
        filtered = (self.x.filtered_all_correct_groups or 0) + (self.x.filtered_all_incorrect_groups or 0)
        if generated is not None and filtered > generated:
            raise InputError("generated_groups", f"at least the groups filtered ({filtered})", describe(generated))

    def parameters(self) -> None:
        """The sequences of tensors (grads, parameters before and after the update, shape for shape)."""
        for name in fields_where("tensors"):
            value = getattr(self.x, name)
            if value is None:
                continue
            if isinstance(value, Tensor) or not all(isinstance(t, Tensor) for t in value):
                raise InputError(name, "a sequence of tensors", describe(value))
            self._set(name, list(value))
        before, after = self.x.params_before, self.x.params_after
        if (before is None) != (after is None):
            raise InputError("params_after", "params_before and params_after together", "only one of them")
        if before is not None:
            after = after or []
            if len(before) != len(after) or any(a.shape != b.shape for a, b in zip(after, before, strict=False)):
                raise InputError(
                    "params_after",
                    f"the {len(before)} shapes of params_before {[tuple(t.shape) for t in before][:4]}",
                    f"{len(after)} tensors of shapes {[tuple(t.shape) for t in after][:4]}",
                )


def _floating(name: str, value: Tensor) -> None:
    if not value.is_floating_point():
        raise InputError(name, "a floating-point tensor (fp32, bf16, fp16 or fp64)", describe(value))


class _Shape:
    """Tracks N and T across fields so the first mismatch names both fields."""

    def __init__(self) -> None:
        self.n: int | None = None
        self.n_from = ""
        self.t: int | None = None
        self.t_from = ""

    def sequence(self, name: str, value: Tensor) -> None:
        if value.dim() != 1:
            raise InputError(name, "shape (N,): one value per completion", describe(value))
        self._n(name, value)

    def tokens(self, name: str, value: Tensor, per_token: bool = False) -> None:
        """(N, T); with ``per_token``, the leading (N, T) of a tensor of more dimensions (the routed experts)."""
        if value.dim() < 2 or (value.dim() != 2 and not per_token):
            raise InputError(name, "shape (N, T): one value per completion token", describe(value))
        self._n(name, value)
        if self.t is None:
            self.t, self.t_from = value.shape[1], name
        elif value.shape[1] != self.t:
            raise InputError(name, f"shape (N, T) with T={self.t} like `{self.t_from}`", describe(value))

    def _n(self, name: str, value: Tensor) -> None:
        if self.n is None:
            self.n, self.n_from = value.shape[0], name
        elif value.shape[0] != self.n:
            raise InputError(name, f"N={self.n} rows like `{self.n_from}`", describe(value))
