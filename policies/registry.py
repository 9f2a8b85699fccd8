"""Eviction policies by name.

A name is either one registered with ``@register`` (see ``available()``) or
``module:Class``: the module is imported, ``Class`` is called with the
parameters, and the result must satisfy ``tierkv.policy.EvictionPolicy``.
Every failure raises ``ConfigError`` naming what failed and what is allowed.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TypeVar

from tierkv.errors import ConfigError
from tierkv.policy import EvictionPolicy

# The members of EvictionPolicy, named in the error when a custom class lacks some.
_PROTOCOL_MEMBERS = ("insert", "touch", "remove", "evict", "__len__")

Factory = Callable[..., object]  # whether it builds an EvictionPolicy is checked on the result
F = TypeVar("F", bound=Factory)

_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[F], F]:
    """Class decorator: make the policy available as ``make_policy(name)``."""
    if not name or ":" in name:
        raise ConfigError(f"policy name {name!r}: must be non-empty and without ':' (reserved for module:Class)")

    def add(factory: F) -> F:
        if name in _REGISTRY:
            raise ConfigError(f"policy name {name!r}: already registered by {_REGISTRY[name]!r}")
        _REGISTRY[name] = factory
        return factory

    return add


def available() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def make_policy(name: str, **params: object) -> EvictionPolicy:
    """A fresh policy from a registered name or a ``module:Class`` path."""
    factory = _import(name) if ":" in name else _registered(name)
    _check_params(name, factory, params)
    return _checked(name, factory(**params))


def _registered(name: str) -> Factory:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"policy={name!r}: unknown; valid names: {', '.join(available())}, "
            f"or 'module:Class' for a custom policy"
        ) from None


def _import(spec: str) -> Factory:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"policy={spec!r}: expected 'module:Class', e.g. 'mypkg.cache:MyPolicy'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"policy={spec!r}: cannot import module {module_name!r}: {err}") from err
    factory: object = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"policy={spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ConfigError(f"policy={spec!r}: {attr!r} is a {type(factory).__name__}, not a class")
    return factory


def _check_params(name: str, factory: Factory, params: dict[str, object]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        return
    try:
        signature.bind(**params)
    except TypeError as err:
        raise ConfigError(f"policy={name!r}: parameters {params} do not fit {signature}: {err}") from None


def _checked(name: str, policy: object) -> EvictionPolicy:
    if isinstance(policy, EvictionPolicy):
        return policy
    missing = [member for member in _PROTOCOL_MEMBERS if not callable(getattr(policy, member, None))]
    raise ConfigError(
        f"policy={name!r}: {type(policy).__qualname__} is not an EvictionPolicy "
        f"(missing: {', '.join(missing)})"
    )
