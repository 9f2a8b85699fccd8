"""Strategies by name: one ``Registry`` per kind (eviction, prefetch, chunk selection, ...).

A name is either one registered with ``@registry.register(name)`` (see
``registry.names()``) or ``module:Class``: the module is imported, ``Class``
is called with the parameters, and the result must satisfy the kind's
protocol. Every failure raises ``ConfigError`` naming what failed and what
is allowed.

The eviction registry keeps its short module-level names: ``register``,
``available()`` and ``make_policy()``.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Generic, TypeVar

from tierkv.errors import ConfigError
from tierkv.policy import EvictionPolicy

Factory = Callable[..., object]  # whether it builds the right kind is checked on the result
F = TypeVar("F", bound=Factory)
P = TypeVar("P")


class Registry(Generic[P]):
    """Named factories of one strategy kind; ``field`` is how errors call it (``policy=...``)."""

    def __init__(self, field: str, protocol: type[P], members: tuple[str, ...]) -> None:
        self.field, self.protocol, self.members = field, protocol, members
        self._factories: dict[str, Factory | str] = {}  # a str is a module:Class path, imported when made

    def register(self, name: str) -> Callable[[F], F]:
        """Class decorator: make the strategy available as ``make(name)``."""
        if not name or ":" in name:
            raise ConfigError(f"{self.field} name {name!r}: must be non-empty and without ':' "
                              f"(reserved for module:Class)")

        def add(factory: F) -> F:
            if name in self._factories:
                raise ConfigError(f"{self.field} name {name!r}: already registered by {self._factories[name]!r}")
            self._factories[name] = factory
            return factory

        return add

    def alias(self, name: str, spec: str) -> None:
        """Make ``module:Class`` available as ``make(name)``, imported only when it is made."""
        self.register(name)(spec)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._factories)

    def make(self, name: str, **params: object) -> P:
        """A fresh strategy from a registered name or a ``module:Class`` path."""
        factory = self._import(name) if ":" in name else self._registered(name)
        self._check_params(name, factory, params)
        return self._checked(name, factory(**params))

    def _registered(self, name: str) -> Factory:
        try:
            factory = self._factories[name]
        except KeyError:
            raise ConfigError(f"{self.field}={name!r}: unknown; valid names: {', '.join(self.names())}, "
                              f"or 'module:Class' for a custom one") from None
        return self._import(factory) if isinstance(factory, str) else factory

    def _import(self, spec: str) -> Factory:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"{self.field}={spec!r}: expected 'module:Class', e.g. 'mypkg.cache:MyPolicy'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(f"{self.field}={spec!r}: cannot import module {module_name!r}: {err}") from err
        factory: object = getattr(module, attr, None)
        if factory is None:
            raise ConfigError(f"{self.field}={spec!r}: module {module_name!r} has no attribute {attr!r}")
        if not inspect.isclass(factory):      # (a function named in a config or trace file is not called)
            raise ConfigError(f"{self.field}={spec!r}: {attr!r} is a {type(factory).__name__}, not a class")
        return factory

    def _check_params(self, name: str, factory: Factory, params: dict[str, object]) -> None:
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # some builtins have no signature: let the call decide
            return
        try:
            signature.bind(**params)
        except TypeError as err:
            raise ConfigError(f"{self.field}={name!r}: parameters {params} do not fit {signature}: {err}") from None

    def _checked(self, name: str, made: object) -> P:
        if isinstance(made, self.protocol):
            return made
        missing = [member for member in self.members if not callable(getattr(made, member, None))]
        raise ConfigError(f"{self.field}={name!r}: {type(made).__qualname__} does not implement "
                          f"{self.protocol.__name__} (missing: {', '.join(missing)})")


EVICTION: Registry[EvictionPolicy] = Registry("policy", EvictionPolicy,
                                               ("insert", "touch", "remove", "evict", "__len__"))
register = EVICTION.register
available = EVICTION.names
make_policy = EVICTION.make
