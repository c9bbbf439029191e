"""JSON decoding that fails closed: each plan type decodes its fields explicitly with these helpers.

A decoder takes the JSON value and returns the typed value or raises ``ValueError`` naming the
path of the bad field (``stages[2].predicted.fwd_ms``), what it expected and what it got; an
unknown or missing field, a string where a number belongs, or an enum spelling this version does
not know is an error, never a raw dict passed through. Encoding is generic (dataclasses to dicts).
Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")
Decoder = Callable[[Any, str], Any]
"""``decoder(value, path)``: the typed value, or ValueError naming ``path``."""


def encode(value: Any) -> Any:
    """Dataclasses to dicts (every field), enums to their values, tuples to lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def fields(cls: type[T], data: Any, path: str, decoders: Mapping[str, Decoder],
           optional: frozenset[str] = frozenset()) -> T:
    """``cls(**decoded)`` from an object with exactly ``decoders``' keys (``optional`` ones may be absent)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or 'plan'} must be an object, got {_kind(data)}")
    unknown = sorted(set(data) - set(decoders))
    if unknown:
        raise ValueError(f"{path or 'plan'} has unknown fields {unknown}")
    missing = sorted(set(decoders) - set(data) - optional)
    if missing:
        raise ValueError(f"{path or 'plan'} lacks fields {missing}")
    return cls(**{name: decode(data[name], _join(path, name)) for name, decode in decoders.items()
                  if name in data})


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path} must be true or false, got {_kind(value)}")
    return value


def integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path} must be an integer, got {_kind(value)}")
    return value


def number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path} must be a number, got {_kind(value)}")
    return float(value)


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{path} must be a string, got {_kind(value)}")
    return value


def optional(decoder: Decoder) -> Decoder:
    return lambda value, path: None if value is None else decoder(value, path)


def tuple_of(decoder: Decoder) -> Decoder:
    def decode(value: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise ValueError(f"{path} must be a list, got {_kind(value)}")
        return tuple(decoder(item, f"{path}[{index}]") for index, item in enumerate(value))
    return decode


def enum_of(kind: type[Enum]) -> Decoder:
    def decode(value: Any, path: str) -> Enum:
        try:
            return kind(value)
        except ValueError:
            known = ", ".join(repr(member.value) for member in kind)
            raise ValueError(f"{path} is {value!r}, which this tessera does not know; expected one of "
                             f"{known}") from None
    return decode


def mapping_of(decoder: Decoder) -> Decoder:
    """An object with string keys and values of one type, frozen."""
    def decode(value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise ValueError(f"{path} must be an object, got {_kind(value)}")
        return MappingProxyType({key: decoder(item, _join(path, key)) for key, item in value.items()})
    return decode


def json_value(value: Any, path: str) -> Any:
    """Free-form JSON data (builder arguments, device figures), frozen: objects read-only, lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({string(key, path): json_value(item, _join(path, key))
                                 for key, item in value.items()})
    if isinstance(value, list):
        return tuple(json_value(item, f"{path}[{index}]") for index, item in enumerate(value))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError(f"{path} holds {_kind(value)}, which is not JSON data")


def json_object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{path} must be an object, got {_kind(value)}")
    return json_value(value, path)


def freeze(value: Any) -> Any:
    """JSON-like data made immutable: dicts become read-only mappings, lists become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]
