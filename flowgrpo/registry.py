"""Name -> factory registries with duplicate refusal, helpful misses, lazy heavy imports and plug-ins
named by import path."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Generic, TypeVar

from .errors import UserError, first_line

T = TypeVar("T")


class PluginError(ValueError):
    """Raised by a registry's plug-in hook: the imported object does not fit the registry's contract
    (the message says what is wrong, in one line)."""


def is_import_path(name: str) -> bool:
    """Whether a configured name is an import path ``"package.module:attr"`` rather than a registered name."""
    return ":" in name


def signature_problem(obj: Callable, *args: Any, **kwargs: Any) -> str | None:
    """None where ``obj(*args, **kwargs)`` binds to ``obj``'s signature, else the signature as text (for
    one-line errors such as ``takes (img), a reward is called as (images, prompts, **metadata)``)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without an introspectable signature: let the call decide
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return f"takes {sig}"
    return None


def describe(obj: Any) -> str:
    """``obj`` in an error line: ``function sharp``, ``class Sharpness``, ``int 3``."""
    if inspect.isclass(obj):
        return f"class {obj.__qualname__}"
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return f"function {obj.__qualname__}"
    text = repr(obj)
    return f"{type(obj).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def import_object(path: str) -> Any:
    """The object at ``"package.module:attr"`` (``attr`` may be dotted: ``module:Class.method``).
    Raises :class:`~flowgrpo.errors.UserError` with one line for a malformed path, a module that does not
    import, and a missing attribute."""
    module, _, attr = path.partition(":")
    if not module or not attr or ":" in attr:
        raise UserError(f"{path!r} is not an import path of the form 'package.module:attr'")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"cannot import module {module!r}: {first_line(exc)}") from None
    except Exception as exc:  # the module raised while importing (a syntax error, a failing top level)
        raise UserError(f"importing module {module!r} failed: {type(exc).__name__}: {first_line(exc)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """A named collection of factories.

    ``@registry.register("name")`` adds a factory and refuses a second one of the same name (this is
    also how user code adds its own: ``@REWARDS.register("mine")`` before the config is loaded).
    ``registry.register_lazy("name", "module:attr")`` records where a heavy factory lives without
    importing it; the module is imported on first :meth:`get`. ``get`` of an unknown name raises
    :class:`~flowgrpo.errors.UserError` listing the valid names.

    **Import paths** (registries made with a ``plugin`` hook: rewards, objectives, strategies,
    estimators). A name containing ``':'`` (``"my_pkg.rewards:sharpness"``) is not looked up but imported (:func:`import_object`) and passed to the registry's ``plugin`` hook, which checks it
    against the registry's contract and returns the factory to use (raising :class:`PluginError`
    saying what does not fit). ``in``, :meth:`get`, :meth:`build` and :meth:`check` accept such names;
    every failure is one line ``<kind> '<path>': <what is wrong>``. Resolved paths are cached and are
    not listed by :meth:`names`.
    """

    def __init__(self, kind: str, plugin: Callable[[str, Any], Callable[..., T]] | None = None):
        """Args: kind, what the registry holds, in messages (``"reward"``); plugin, ``(path, obj) ->
        factory`` for names given as import paths (None: the registry takes registered names only)."""
        self.kind = kind
        self._items: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, str] = {}
        self._plugin = plugin
        self._paths: dict[str, Callable[..., T]] = {}

    def _check_free(self, name: str) -> None:
        if name in self._items or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered")

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        if is_import_path(name):
            raise ValueError(f"{self.kind} name {name!r} contains ':', which marks an import path; choose another name")

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

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a KeyError if it is not registered): for entries that live only as long as
        the code that added them, e.g. a benchmark's model, so that later users see the registry as
        it was."""
        if name in self._items:
            del self._items[name]
        elif name in self._lazy:
            del self._lazy[name]
        else:
            raise KeyError(f"{self.kind} {name!r} is not registered")

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._lazy))

    def _resolve(self, path: str) -> Callable[..., T]:
        """The factory of the import path ``path`` (imported, checked by the plug-in hook, cached)."""
        if path not in self._paths:
            try:
                factory = self._plugin(path, import_object(path))
            except (UserError, PluginError) as exc:
                raise UserError(f"{self.kind} {path!r}: {exc}") from None
            self._paths[path] = factory
        return self._paths[path]

    def check(self, name: str) -> None:
        """Raise a one-line :class:`~flowgrpo.errors.UserError` unless ``name`` is registered or an
        import path that resolves and fits the contract. Registered lazy names are not imported."""
        if name in self._items or name in self._lazy:
            return
        if self.takes_paths(name):
            self._resolve(name)
            return
        paths = " (or an import path 'package.module:attr')" if self._plugin is not None else ""
        raise UserError(f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}{paths}")

    def takes_paths(self, name: str) -> bool:
        """Whether ``name`` is an import path and this registry takes plug-ins by import path."""
        return self._plugin is not None and is_import_path(name)

    def __contains__(self, name: str) -> bool:
        if name in self._items or name in self._lazy:
            return True
        if not self.takes_paths(name):
            return False
        try:
            self._resolve(name)
        except UserError:
            return False
        return True

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
        self.check(name)  # an import path resolves; anything else raises the one-line miss
        return self._paths[name]

    def build(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)
