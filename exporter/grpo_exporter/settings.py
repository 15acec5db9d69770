"""The base of every validated settings model (the monitor's, the metric math's, the rules'): what no setting may
hold, whatever its field: NaN or infinity, a bool where a number is meant, a value too large to validate."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from grpo_exporter.config_files import MAX_DEPTH, MAX_NODES, Oversized, check_value_size


def member_types(annotation: Any) -> tuple[set[Any], bool]:
    """The types of a (possibly Optional) field annotation, without None, and whether None is one of them."""
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    kinds = {kind for kind in members if kind is not type(None)}
    return kinds, len(kinds) < len(members)


def number_type(annotation: Any) -> type | None:
    """``int`` or ``float`` for a field annotated with one of them, alone or with None; else None."""
    kinds, _ = member_types(annotation)
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    return kind if kind in (int, float) else None


class Settings(BaseModel):
    """The base of every validated settings model: frozen, an unknown key is an error, every float is finite
    (NaN compares false with every line, so a NaN line silently disables it; an infinite duration never ends),
    a bool is no number (``port=True`` would bind port 1, ``solve_rate_slots=True`` make a 1-slot table), and a
    value too large to validate or show (a "billion laughs" given in code) is refused naming its field."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _bool_is_no_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            kind = number_type(cls.model_fields[info.field_name].annotation)
            if kind is not None:
                raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, got the bool {value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _oversized_values_stand_aside(cls, data: Any) -> Any:
        """Each value too large to validate or show (:func:`check_value_size`) is replaced by a stand-in with a
        short repr, which :meth:`_no_oversized_value` refuses naming the field: pydantic's error would show the
        value itself, and a billion-laughs structure given in code takes minutes to print."""
        if not isinstance(data, dict):
            return data
        replaced = {}
        for name, value in data.items():
            try:
                check_value_size(value)
            except ValueError as exc:
                replaced[name] = Oversized(str(exc))
        return {**data, **replaced} if replaced else data

    @field_validator("*", mode="before")
    @classmethod
    def _no_oversized_value(cls, value: Any) -> Any:
        if isinstance(value, Oversized):
            raise ValueError(f"expected at most {MAX_NODES} nested items, {MAX_DEPTH} levels deep, got {value.reason}")
        return value
