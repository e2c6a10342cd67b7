"""Load a YAML file + dotlist overrides into the typed config tree, with errors that name the key.

OmegaConf does the YAML / dotlist parsing and merging (so ``5e-4``, ``null`` and ``[a,b]`` parse the
way verl users expect); the result is a plain dict that :func:`from_dict` turns into dataclasses,
checking every key and type itself so that the error messages are ours.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any, Iterable, Union

import yaml
from omegaconf import OmegaConf

from hybridflow.config.schema import HybridFlowConfig
# ConfigError, dotted_tree and _merge live in tree.py (shared with verl_compat.py); importable from here too.
from hybridflow.config.tree import ConfigError, dotted_tree  # noqa: F401  (dotted_tree re-exported)
from hybridflow.config.tree import merge as _merge
from hybridflow.config.verl_compat import translate_verl_keys


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _bad(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (possibly converted)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):  # Optional[X], or X | Y: the first member the value fits
        if value is None and type(None) in args:
            return None
        for inner in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, inner, key)
            except ConfigError:
                pass
        raise _bad(key, tp, value)
    if origin is typing.Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} is a section and must be a mapping of keys, got {value!r} "
                              f"({type(value).__name__})")
        return from_dict(tp, value, key)
    if origin is dict:
        key_tp, val_tp = args or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping ({_type_name(tp)}), got {value!r} ({type(value).__name__})")
        return {_coerce(k, key_tp, f"{key} (a key)"): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = args or (Any,)
        if isinstance(value, str) and item_tp is str:
            value = [value]  # `trainer.logger=console` means ["console"]
        if not isinstance(value, (list, tuple)):
            raise _bad(key, tp, value)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be bool (true/false), got {value!r} ({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # no key means "unlimited" by inf: each has its own spelling (null / -1)
                raise ConfigError(f"{key} must be a finite number, got {value!r}")
            return float(value)
        raise _bad(key, tp, value)
    if tp in (int, str):
        if isinstance(value, tp) and not isinstance(value, bool):
            return value
        raise _bad(key, tp, value)
    raise _bad(key, tp, value)  # pragma: no cover - an annotation this loader does not know


def literal_choices(cls: type, name: str) -> list:
    """The allowed values of a `Literal[...]` field of dataclass `cls` (the validator reads them here)."""
    return list(typing.get_args(typing.get_type_hints(cls)[name]))


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        full = f"{path}.{k}" if path else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            prefix = f"{path}." if path else ""
            nested = _nested_home(cls, hints, str(k))
            if nested:  # a section written without its parent: `actor.clip_ratio_high` -> `actor_rollout_ref.actor.clip_ratio_high`
                hint = "did you mean " + " or ".join(f"'{prefix}{home}.{k}{_first_leaf(v)}'" for home in nested) + "?"
            elif close:
                hint = f"did you mean '{prefix}{close[0]}'?"
            else:
                hint = f"valid keys{' under ' + repr(path) if path else ''}: {sorted(names)}"
            raise ConfigError(f"unknown config key '{full}{_first_leaf(v)}'; {hint}")
        kwargs[k] = _coerce(v, hints[k], full)
    return cls(**kwargs)


def _nested_home(cls: type, hints: dict, name: str) -> list[str]:
    """The sections of ``cls`` that hold a field ``name`` (verl nests ``actor``, ``rollout``, ``ref``
    and ``model`` under ``actor_rollout_ref``): where a key written without its parent belongs."""
    homes = [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])
             and name in {g.name for g in dataclasses.fields(hints[f.name])}]
    return sorted(homes, key=lambda h: h != "actor_rollout_ref")  # the policy's section first


def _first_leaf(value: Any) -> str:
    """``.a.b`` for {"a": {"b": 1}}: the rest of the dotted key a user wrote, for the error message."""
    out = ""
    while isinstance(value, dict) and len(value) == 1:
        (k, value), = value.items()
        out += f".{k}"
    return out


def _parse_overrides(overrides: Iterable[str]) -> dict:
    items = list(overrides)
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"bad override {item!r}: overrides have the form key=value "
                              f"(e.g. actor_rollout_ref.rollout.n=8)")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(items), resolve=True)
    except Exception as e:  # omegaconf grammar errors
        raise ConfigError(f"cannot parse overrides {items}: {e}") from None


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(path)
        data = OmegaConf.to_container(loaded, resolve=True)
    except Exception as e:
        raise ConfigError(f"cannot parse config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must contain a mapping of keys at the top level")
    return data


def load_config(path: str | None, overrides: Iterable[str] = (), schema: type = HybridFlowConfig) -> Any:
    """YAML file (optional) < dotlist overrides < ... into a ``schema`` instance (not validated)."""
    data = _read_yaml(path) if path else {}
    data = _merge(data, _parse_overrides(overrides))
    if schema is HybridFlowConfig:  # verl's keys: mapped, accepted or refused with the reason
        data = translate_verl_keys(data, schema)
    return from_dict(schema, data)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str) -> None:
    """Write the resolved config as YAML; ``load_config(path, schema=type(cfg))`` gives it back."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False, default_flow_style=False)
