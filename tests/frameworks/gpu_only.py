"""Import stand-ins for the GPU-only packages OpenRLHF's trainer modules import at module level (flash-attn,
vLLM, ring-flash-attn: no CPU build exists), so the CPU tests can import OpenRLHF's real trainer classes and
functions. Nothing of them is ever run: every name is a class that raises when it is instantiated or called,
naming itself, so a test that reached GPU code would fail, never pass on a stand-in."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

GPU_ONLY = ("flash_attn", "vllm", "ring_flash_attn")


class _Absent(type):
    def __getattr__(cls, name: str) -> Any:
        return _absent(f"{cls.__qualname__}.{name}")


def _absent(name: str) -> Any:
    def refuse(*_: Any, **__: Any) -> None:
        raise RuntimeError(f"{name}: a GPU-only package stood in for at import by the CPU tests was called")

    return _Absent(name, (), {"__init__": refuse, "__call__": refuse})


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in GPU_ONLY:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Put the stand-ins last on the import path (idempotent): a real package, where installed, is found first."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
