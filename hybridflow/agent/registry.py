"""One decorator factory for the agent package's registries (tools, formats, environments, loops)."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T", bound=type)


def class_registry(kind: str, table: dict[str, type], set_name: bool = False) -> Callable[[str], Callable[[T], T]]:
    """``register(name)`` -> class decorator that files the class in ``table`` under ``name``.

    Registering the same class again is a no-op (a module imported twice); another class under a
    taken name is an error. ``set_name`` also stores the name on the class (``cls.name``)."""

    def register(name: str) -> Callable[[T], T]:
        def deco(cls: T) -> T:
            old = table.get(name)
            if old is not None and old is not cls:
                raise ValueError(f"{kind} {name!r} is already registered to {old.__qualname__}")
            if set_name:
                cls.name = name
            table[name] = cls
            return cls

        return deco

    return register
