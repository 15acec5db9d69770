"""``GRPO_EXPORTER_*`` environment variables as settings of a pydantic model (the monitor's configuration).

A variable is read only when it names a field, and parsed by that field's type: a string field takes the text
as it is (``GRPO_EXPORTER_RUN=42`` is the run "42"), numbers and booleans are parsed as such, lists take JSON
(``[2, 4]``) or ``a,b``, a mapping JSON or a YAML file's path; an empty value is None where that is the
default, and an optional number takes ``none`` or ``null`` too. Any other ``GRPO_EXPORTER_*`` variable is
logged once with the nearest setting's name and otherwise ignored (a typo must not stop a run), except those
read elsewhere (:data:`OTHER_VARIABLES`). A value that fails validation is reported with its variable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError
from rapidfuzz import process

from grpo_exporter.config_files import short_repr
from grpo_exporter.settings import member_types

ENV_PREFIX = "GRPO_EXPORTER_"
#: ``GRPO_EXPORTER_*`` variables that are no setting, read elsewhere: never warned about
#: (``grpo_exporter.integrations.ALLOW_UNTESTED_ENV``)
OTHER_VARIABLES = frozenset({"GRPO_EXPORTER_ALLOW_UNTESTED"})
_LOG = logging.getLogger("grpo_exporter")
_WARNED: set[str] = set()  # unknown variables already logged in this process


#: a setting of the environment that is no field: ``clip_eps`` sets both sides of the clip band
_PSEUDO_FIELDS = {"clip_eps": FieldInfo(annotation=float | tuple[float, float])}
_NONE_WORDS = ("", "none", "null")


def environment_settings(model: type[BaseModel], environ: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """field -> (variable, value) of every ``GRPO_EXPORTER_<FIELD>`` of ``environ``, each parsed by its field's
    type (:func:`_env_value`); any other ``GRPO_EXPORTER_*`` variable is logged once (:func:`_unknown`) unless
    it is one of :data:`OTHER_VARIABLES`. A list or mapping that is not valid JSON fails naming the variable."""
    fields: dict[str, FieldInfo] = {**model.model_fields, **_PSEUDO_FIELDS}
    found: dict[str, tuple[str, Any]] = {}
    errors: list[InitErrorDetails] = []
    for variable, raw in environ.items():
        if not variable.startswith(ENV_PREFIX) or variable in OTHER_VARIABLES:
            continue
        name = variable.removeprefix(ENV_PREFIX).lower()
        if name not in fields:
            _unknown(variable, list(fields))
            continue
        try:
            found[name] = (variable, _env_value(raw, fields[name]))
        except (ValueError, RecursionError):
            errors.append(_variable_error(variable, name, raw, fields[name], "(not valid JSON)"))
    if errors:
        raise ValidationError.from_exception_data(model.__name__, errors)
    return found


def _unknown(variable: str, fields: list[str]) -> None:
    """Log, once per process, a ``GRPO_EXPORTER_*`` variable that names no setting, with the nearest one: a
    typo must not pass unnoticed, nor stop the run."""
    if variable in _WARNED:
        return
    _WARNED.add(variable)
    name = variable.removeprefix(ENV_PREFIX).lower()
    guess = process.extractOne(name, fields, score_cutoff=60)
    hint = f"; did you mean {ENV_PREFIX}{guess[0].upper()}?" if guess else ""
    _LOG.warning("%s is not a grpo-exporter setting and is ignored%s (the settings: docs/config-exporter.md)",
                 variable, hint)


def _env_value(raw: str, info: FieldInfo) -> Any:
    """The value a variable's text gives the field ``info``: None for an empty text where None is the default
    (an empty variable means what an unset one does), and for ``none``/``null`` where the field is an optional
    number (``GRPO_EXPORTER_PORT=none`` serves nothing); a list from JSON (``[...]``) or ``a,b`` where it is a
    sequence; a mapping from JSON (``{...}``), else the text (a YAML file's path); otherwise the text, stripped
    for a non-string type, which pydantic then parses by the field's type. ``ValueError`` for a list or mapping
    that is not valid JSON."""
    kinds, optional = member_types(info.annotation)
    text = raw.strip()
    if optional and text.lower() in _NONE_WORDS and (info.default is None if text == "" else not kinds & {str, Path}):
        return None
    if any(get_origin(kind) in (tuple, list, set, frozenset) for kind in kinds) and (
        text.startswith("[") or "," in text or not kinds & {int, float}
    ):
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",")] if text else []
    if any(get_origin(kind) is dict for kind in kinds) and text.startswith("{"):
        return json.loads(text)
    return raw if kinds & {str, Path} or any(get_origin(kind) is dict for kind in kinds) else text


def naming_variables(exc: ValidationError, model: type[BaseModel], sources: Mapping[str, str],
                     raw: Mapping[str, str]) -> ValidationError:
    """``exc`` with each error of a field that came from the environment told as its variable's: what the field
    expects and the text that came. Returned unchanged when no error came from there."""
    if not any(_field_of(err) in sources for err in exc.errors()):
        return exc
    fields: dict[str, FieldInfo] = {**model.model_fields, **_PSEUDO_FIELDS}
    details: dict[tuple[Any, str], InitErrorDetails] = {}  # one per place and message: clip_eps sets two fields
    for err in exc.errors():
        field = _field_of(err)
        if field in sources:
            variable = sources[field]
            name = variable.removeprefix(ENV_PREFIX).lower()
            detail = _variable_error(variable, name, raw[variable], fields[name], f"({err['msg']})")
        else:
            detail = InitErrorDetails(type=PydanticCustomError(err["type"], "{message}", {"message": err["msg"]}),
                                      loc=err["loc"], input=err["input"])
        details.setdefault((detail["loc"], str(detail["type"])), detail)
    return ValidationError.from_exception_data(exc.title, list(details.values()))


def _field_of(err: Any) -> str:
    """The field an error is about: its location, or for a check of the whole model (``pass_k`` against
    ``group_size``) the field its message starts with (``"pass_k: expected ..."``); '' when neither says."""
    if err["loc"]:
        return str(err["loc"][0])
    message = str(err["msg"]).removeprefix("Value error, ")
    head, colon, _ = message.partition(":")
    return head if colon and head.isidentifier() else ""


def _variable_error(variable: str, name: str, raw: str, info: FieldInfo, detail: str) -> InitErrorDetails:
    """A validation error of the field ``name`` that tells the variable, what it expects and what came."""
    message = f"{variable}: expected {describe(info)}, got {short_repr(raw)} {detail}"
    return InitErrorDetails(type=PydanticCustomError("environment_variable", "{message}", {"message": message}),
                            loc=(name,), input=raw)


def describe(info: FieldInfo) -> str:
    """What a field takes, in words: ``an integer 0..65535, or none``, ``one of 'warn', 'raise', 'off'``."""
    kinds, optional = member_types(info.annotation)
    words = " or ".join(_kind_words(kind, info.metadata) for kind in sorted(kinds, key=str))
    if optional:
        words += ", or none (empty)" if kinds & {str, Path} else ", or none"
    return words


def _kind_words(kind: Any, metadata: list[Any]) -> str:
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(kind))
    if get_origin(kind) in (tuple, list, set, frozenset):
        items = [_kind_words(item, []) for item in get_args(kind) if item is not Ellipsis]
        most = next((m.max_length for m in metadata if isinstance(m, annotated_types.MaxLen)), None)
        bound = f"; at most {most} items" if most is not None else ""
        return f"a JSON list or comma-separated list (each {' or '.join(dict.fromkeys(items))}{bound})"
    if get_origin(kind) is dict:
        return "a JSON mapping or the path of a YAML file"
    simple = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", Path: "a path"}
    return simple.get(kind, str(kind)) + _bounds(metadata)


def _bounds(metadata: list[Any]) -> str:
    """`` 0..65535``, `` > 0``, `` >= 1``, `` of 1 to 128 characters`` from a field's annotated-types metadata."""
    low = next(((_number(m.ge), ">=") for m in metadata if isinstance(m, annotated_types.Ge)), None)
    low = low or next(((_number(m.gt), ">") for m in metadata if isinstance(m, annotated_types.Gt)), None)
    high = next(((_number(m.le), "<=") for m in metadata if isinstance(m, annotated_types.Le)), None)
    high = high or next(((_number(m.lt), "<") for m in metadata if isinstance(m, annotated_types.Lt)), None)
    if low and high and low[1] == ">=" and high[1] == "<=":
        return f" {low[0]}..{high[0]}"
    parts = [f"{pair[1]} {pair[0]}" for pair in (low, high) if pair]
    shortest = next((m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)), None)
    longest = next((m.max_length for m in metadata if isinstance(m, annotated_types.MaxLen)), None)
    if longest is not None:
        parts.append(f"of {shortest or 0} to {longest} characters")
    return (" " + " and ".join(parts)) if parts else ""


def _number(bound: Any) -> str:
    """A bound as written: 3600, 0.5, 65535 (a whole float without its ``.0``)."""
    return str(int(bound)) if isinstance(bound, float) and bound.is_integer() else str(bound)
