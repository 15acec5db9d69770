"""Configuration files and values read within limits: a hostile or mistaken input fails at once, naming the setting.

A settings file, a reference baseline or a rules config is a small YAML mapping. Each is read from a regular
file of at most :data:`MAX_FILE_BYTES`, its aliases expanded at most to :data:`MAX_NODES` nodes and
:data:`MAX_DEPTH` levels before anything is constructed (a "billion laughs" is refused, not built), and every
error is a :class:`ConfigFileError` naming the setting, what was expected and what came, in a few hundred
characters (:func:`short_repr`): formatting an error never costs more than reading the file.
"""

from __future__ import annotations

import os
import reprlib
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml


class Oversized:
    """Stands in for a setting's value too large to validate or show; its repr is short."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<{self.reason}>"



class ConfigFileError(ValueError):
    """A configuration file that cannot be read as a bounded YAML mapping; the message names the setting, what
    was expected and what came."""


#: the largest configuration file read: settings and baselines take a few KiB (a baseline of every catalogue
#: series well under 100 KiB); the cap (at most one byte more is read) makes a log file or a dump passed by
#: mistake fail at once, and bounds the pure-Python YAML parse of the largest accepted file to about a second
MAX_FILE_BYTES = 256 << 10
#: scalars, sequences and mappings a document (or a value given in code) may expand to, each alias counted at
#: every place it is used: a real configuration has hundreds; a "billion laughs" of nested aliases expands to
#: billions, and validating it, or showing it in an error, would take minutes and all memory
MAX_NODES = 100_000
#: nesting a document or value may reach (aliases included): a configuration is 3 levels deep
MAX_DEPTH = 64


def _short_reprs() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 2, 80, 80
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = short.maxfrozenset = 4
    return short


_SHORT = _short_reprs()


def short_repr(value: object) -> str:
    """A bounded repr for error messages: a hostile value (a huge string, a deep or shared structure) costs a
    few hundred characters, never its full size."""
    return _SHORT.repr(value)


def _file_text(path: Path, setting: str) -> str:
    """The UTF-8 text of the regular file ``path``, at most :data:`MAX_FILE_BYTES`. Opened non-blocking (a FIFO
    must not wait for a writer) and checked on the open descriptor, so the file checked is the file read."""
    expected = f"{setting}: expected a readable UTF-8 YAML file of at most {MAX_FILE_BYTES >> 10} KiB, got"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigFileError(f"{expected} a missing path {short_repr(str(path))}") from None
    except OSError as exc:
        raise ConfigFileError(f"{expected} {short_repr(str(path))}, which cannot be opened ({exc.strerror})") from None
    except ValueError as exc:  # an embedded NUL byte
        raise ConfigFileError(f"{expected} {short_repr(str(path))}, which is no path ({exc})") from None
    try:
        status = os.fstat(fd)
        mode = status.st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
            raise ConfigFileError(f"{expected} {kind} {short_repr(str(path))}")
        data = _read_at_most(fd, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError(f"{expected} {short_repr(str(path))}, which cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        size = status.st_size if status.st_size > MAX_FILE_BYTES else f"more than {MAX_FILE_BYTES}"
        raise ConfigFileError(f"{expected} {short_repr(str(path))} of {size} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = f"byte {exc.start}: {data[exc.start:exc.start + 1]!r}"
        raise ConfigFileError(f"{expected} {short_repr(str(path))}, which is not UTF-8 ({bad})") from None


def _read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of the open file ``fd`` (fewer at its end)."""
    chunks: list[bytes] = []
    while limit > 0 and (chunk := os.read(fd, min(limit, 1 << 16))):
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader; :func:`_bounded_yaml` checks what it composed before constructing anything."""


def _yaml_children(node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _value_children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, list | tuple | set | frozenset):
        return list(value)
    return []


def check_expansion(root: Any, children: Callable[[Any], list[Any]], what: str) -> None:
    """Raise ``ValueError`` saying why when ``root`` (a composed YAML node, or a Python value) expands past
    :data:`MAX_NODES` nodes or :data:`MAX_DEPTH` levels with every shared part (an alias) counted where it is
    used, or contains itself. The walk is memoised per object, so it is linear in the distinct objects however
    far they expand, and never recurses deeper than :data:`MAX_DEPTH`."""
    _expanded_size(root, children, what, 0, {}, set())


def _expanded_size(node: Any, children: Callable[[Any], list[Any]], what: str, depth: int,
                   sizes: dict[int, tuple[int, int]], open_: set[int]) -> int:
    """(Part of :func:`check_expansion`.) ``sizes``: id -> (nodes, height) of the objects walked so far;
    ``open_``: the ids on the path from the root."""
    if id(node) in open_:
        raise ValueError(f"{what} that contains itself (a recursive alias)")
    known = sizes.get(id(node))
    if depth + (known[1] if known else 0) > MAX_DEPTH:
        raise ValueError(f"{what} nested deeper than {MAX_DEPTH} levels")
    if known is not None:
        return known[0]
    open_.add(id(node))
    size, height = 1, 0
    for child in children(node):
        size += _expanded_size(child, children, what, depth + 1, sizes, open_)
        height = max(height, sizes[id(child)][1] + 1)
        if size > MAX_NODES:
            raise ValueError(f"{what} that expands to more than {MAX_NODES} nodes (aliases counted where used)")
    open_.discard(id(node))
    sizes[id(node)] = (size, height)
    return size


def check_value_size(value: Any) -> None:
    """:func:`check_expansion` of a Python value (nested lists, tuples, sets, dicts): a setting given in code is
    held to the same bounds as one read from a file, as validating or showing a larger one stalls."""
    check_expansion(value, _value_children, "a value")


def _bounded_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing before construction a document whose aliases expand past
    :data:`MAX_NODES` nodes or :data:`MAX_DEPTH` levels (a "billion laughs", merge keys included:
    merging copies), or that contains itself. ``ValueError`` or ``yaml.YAMLError`` saying what is wrong."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_expansion(node, _yaml_children, "a document")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml_mapping(path: str | Path, what: str, setting: str = "config file") -> dict[str, Any]:
    """A YAML file that must hold a mapping (an empty file is an empty one); ``what`` names its content and
    ``setting`` the option that named the file, in every error (:class:`ConfigFileError`). The file is read
    within limits (:data:`MAX_FILE_BYTES`, :data:`MAX_NODES`, :data:`MAX_DEPTH`), so a hostile or
    mistaken file fails at once with a short message instead of stalling or exhausting memory."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ConfigFileError(f"{setting}: expected a path to a YAML file, got {short_repr(path)}")
    text_path = str(path)
    shown = f"{setting} {text_path if text_path.isprintable() and len(text_path) <= 200 else short_repr(text_path)}"
    text = _file_text(Path(path), setting)
    try:
        loaded = _bounded_yaml(text)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        problem = " ".join(str(exc).split()) if not isinstance(exc, RecursionError) else "nesting too deep to parse"
        raise ConfigFileError(f"{shown}: expected YAML {what}, got {problem[:300]}") from None
    loaded = {} if loaded is None else loaded
    if not isinstance(loaded, Mapping):
        raise ConfigFileError(f"{shown}: expected a YAML mapping of {what}, got {type(loaded).__name__}")
    return dict(loaded)
