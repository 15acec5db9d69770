"""Passes over (N, T) of a compiled step: what :func:`~grpo_exporter.bench.probes.passes` counts for the eager
step, counted where a compiled program hides it from the dispatcher.

A compiled program (inductor's output module) runs its fused kernels as C functions and its extern operators
(a sort, ``index_put_``, the traced ``bincount``) from its Python wrapper; a dispatch mode around it would see
neither, and would make dynamo refuse the program (its guards check the tensors' dispatch keys). So, while
counting, the wrapper's names are replaced in every loaded output module:

* each fused kernel counts its **loop nests** that visit at least half of N x T positions, at the sizes it is
  called with (:meth:`Nest.positions`; a loop nest reads its inputs once, which is what a pass is);
* ``aten``, ``torch.ops`` and ``extern_kernels`` count the operators they launch as the dispatch mode does
  (at least half of N x T values read or written; views and allocations are not passes);

and the program itself runs with the dispatch mode suspended, so that what the monitor does around it is
counted by the dispatch mode and nothing twice.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grpo_exporter.bench.probes import is_pass, passes

_KERNEL = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[[^\]]*\], r'''(.*?)'''\)", re.M | re.S)
_INT_PARAM = re.compile(r"const int64_t (\w+)")
_FOR = re.compile(r"\bfor\s*\(")
_LITERAL = re.compile(r"\b(\d+)L\b")


class Nest:
    """One loop of a kernel and the loops inside it: its variable, the bounds of that variable (inductor's C++
    expressions of the kernel's integer sizes) and its inner loops."""

    def __init__(self, variable: str, lower: str, upper: str, inner: list[Nest]) -> None:
        self.variable, self.lower, self.upper, self.inner = variable, lower, upper, inner

    def positions(self, sizes: dict[str, int], outer: frozenset[str] = frozenset()) -> int:
        """The positions this loop nest visits at these sizes: the product over its iteration variables (``x0``,
        ``x1``...) of each one's range, along its deepest chain. A vector loop's lane and tail loops
        (``x0_inner``, ``x0_tail``) cover the positions of their variable again, and the other loops
        (accumulator lanes, threads) visit none of the tensors' positions."""
        variable = _ITERATION.match(self.variable)
        if variable is None or variable[1] in outer:
            own, seen = 1, outer
        else:
            own = max(_evaluate(self.upper, sizes) - _evaluate(self.lower, sizes), 0)
            seen = outer | {variable[1]}
        return own * max((n.positions(sizes, seen) for n in self.inner), default=1)


_ITERATION = re.compile(r"(x\d+)(?:_\w+)?$")


def _evaluate(bound: str, sizes: dict[str, int]) -> int:
    """A loop's bound (lower or upper), as inductor writes it in C++ (``static_cast``,
    ``c10::div_floor_integer``, ``16L``), at these sizes."""
    text = bound.replace("static_cast<int64_t>", "").replace("c10::convert<int64_t>", "")
    text = text.replace("c10::div_floor_integer", "_floordiv").replace("std::max", "max").replace("std::min", "min")
    text = _LITERAL.sub(r"\1", text)
    names = {"_floordiv": lambda a, b: a // b, "max": max, "min": min, "__builtins__": {}}
    try:
        return int(eval(text, names, dict(sizes)))
    except Exception as e:
        raise ValueError(f"a compiled kernel's loop bound: expected an expression of {sorted(sizes)}, "
                         f"came {bound!r} ({e})") from e


def _closing(text: str, start: int, opening: str, closing: str) -> int:
    """Index just past the bracket that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"a compiled kernel's source: unbalanced {opening}{closing} from offset {start}")


def nests(source: str) -> list[Nest]:
    """The outermost loop nests of one kernel's C++ source."""
    loops: list[tuple[int, int, tuple[str, str, str]]] = []  # (start, end of body, (variable, lower, upper))
    for match in _FOR.finditer(source):
        header_end = _closing(source, match.end() - 1, "(", ")")
        clauses = source[match.end():header_end - 1].split(";")
        if len(clauses) != 3 or "<" not in clauses[1] or "=" not in clauses[0]:
            raise ValueError(f"a compiled kernel's loop: expected 'for(type x = lower; x < upper; step)', came "
                             f"{source[match.start():header_end]!r}")
        declared, lower = clauses[0].split("=", 1)
        upper = clauses[1].split("<", 1)[1]
        body = header_end + len(source[header_end:]) - len(source[header_end:].lstrip())
        end = _closing(source, body, "{", "}") if source[body] == "{" else source.index(";", body) + 1
        loops.append((match.start(), end, (declared.split()[-1], lower.strip(), upper.strip())))

    def within(start: int, end: int) -> list[Nest]:
        out: list[Nest] = []
        position = start
        for s, e, bounds in loops:
            if s >= position and e <= end and s < end:
                out.append(Nest(*bounds, within(s + 1, e)))
                position = e
        return out

    return within(0, len(source))


class KernelNests:
    """A kernel's integer parameters (inductor's ``ks0``, ``ks1``...: the last arguments of every call, in
    this order) and its loop nests."""

    def __init__(self, source: str) -> None:
        opening = source.index("(", source.index('extern "C"'))
        closing = _closing(source, opening, "(", ")")
        self.sizes = _INT_PARAM.findall(source[opening:closing])
        self.nests = nests(source[source.index("{", closing):])

    def passes(self, args: tuple[Any, ...], elements: int) -> int:
        sizes = dict(zip(self.sizes, args[len(args) - len(self.sizes):], strict=True))
        return sum(2 * n.positions(sizes) >= elements for n in self.nests)


class _Launches:
    """A name of the wrapper (``aten``, ``torch``, ``extern_kernels``) whose operators count."""

    def __init__(self, target: Any, found: list[int], elements: int, wrap_all: bool = False) -> None:
        self._target, self._found, self._elements, self._wrap_all = target, found, elements, wrap_all

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if isinstance(value, (torch._ops.OpOverloadPacket, torch._ops.OpOverload, torch._ops._OpNamespace,
                              torch._ops._Ops)) or (self._wrap_all and callable(value)):
            return _Launches(value, self._found, self._elements)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._target(*args, **kwargs)
        self._found[0] += is_pass(self._target, (args, kwargs, out), self._elements)
        return out


@contextlib.contextmanager
def _counting_programs(elements: int) -> Iterator[list[int]]:
    """While inside, every loaded compiled program counts its passes into the one-element list yielded, and
    runs with any dispatch mode suspended."""
    from torch._inductor.codecache import PyCodeCache
    from torch.utils._python_dispatch import _disable_current_modes

    import grpo_exporter.step.program as program

    found = [0]
    saved: list[tuple[Any, str, Any]] = []
    for module in list(PyCodeCache.modules):
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            code = f.read()
        for name, source in _KERNEL.findall(code):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _kernel(getattr(module, name), KernelNests(source), found, elements))
        for name, wrap_all in (("aten", False), ("torch", False), ("extern_kernels", True)):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _Launches(getattr(module, name), found, elements, wrap_all))
    frames = program.exporter_frames

    @contextlib.contextmanager
    def unobserved() -> Iterator[None]:
        with _disable_current_modes(), frames():
            yield

    saved.append((program, "exporter_frames", frames))
    program.exporter_frames = unobserved
    try:
        yield found
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _kernel(kernel: Callable[..., Any], layout: KernelNests, found: list[int], elements: int) -> Callable[..., Any]:
    def counted(*args: Any) -> Any:
        found[0] += layout.passes(args, elements)
        return kernel(*args)

    return counted


def compiled_passes(run: Callable[[], Any], elements: int) -> int:
    """Passes over (N, T) (``elements`` values) made by ``run()``, a compiled step: the dispatcher's count of
    what runs outside the compiled programs, and the programs' loop nests and extern operators."""
    with _counting_programs(elements) as inside:
        outside = passes(run, elements)
    return outside + inside[0]
