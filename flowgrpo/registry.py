"""Name -> factory registries with duplicate refusal, helpful misses and lazy heavy imports."""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

from .errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of factories.

    ``@registry.register("name")`` adds a factory and refuses a second one of the same name.
    ``registry.register_lazy("name", "module:attr")`` records where a heavy factory lives without
    importing it; the module is imported on first :meth:`get`. ``get`` of an unknown name raises
    :class:`~flowgrpo.errors.UserError` listing the valid names.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, str] = {}

    def _check_free(self, name: str) -> None:
        if name in self._items or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered")

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(fn: Callable[..., T]) -> Callable[..., T]:
            if self._lazy.get(name) == f"{fn.__module__}:{fn.__qualname__}":
                del self._lazy[name]  # the lazy entry resolving to itself
            self._check_free(name)
            self._items[name] = fn
            return fn

        return deco

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``"package.module:attr"`` under ``name`` without importing it."""
        self._check_free(name)
        self._lazy[name] = target

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._lazy))

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._lazy

    def get(self, name: str) -> Callable[..., T]:
        if name in self._items:
            return self._items[name]
        if name in self._lazy:
            module, attr = self._lazy[name].split(":")
            mod = importlib.import_module(module)
            if name not in self._items:  # the module did not self-register under this name
                self._items[name] = getattr(mod, attr)
                self._lazy.pop(name, None)
            return self._items[name]
        raise UserError(f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}")

    def build(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)
