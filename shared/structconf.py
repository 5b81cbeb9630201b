"""Configuration files read into msgspec structs, refused in the words of the file.

Every configuration (``shared/config.py`` for the services and operators,
``services/agent/config.py`` for the node agent) is a tree of ``Section``
structs: msgspec checks the shape (unknown keys, missing keys, types), each
struct's ``__post_init__`` checks what its values mean and raises ``Invalid``
naming its key, and ``convert`` turns whatever msgspec reports into one
sentence for the person who wrote the file::

    /etc/llmgw/scheduler.yaml: health.heartbeat_intervl: unknown key; did you mean 'heartbeat_interval'?
    /etc/llmgw/agent.yaml: supervisor.log_lines: expected a whole number, got a string 'many'
    /etc/llmgw/agent.yaml: fabrics[0].hcas: required key is missing

Three rules hold for every file: an empty value (``health:`` with nothing
under it, ``~``) is the same as leaving the key out, so the default applies; a
``Duration`` field takes ``500ms``, ``5s``, ``1m``, ``1h30m`` or seconds; and a
field whose type is ``Annotated[..., msgspec.Meta(description=...)]`` is
described by that text when a value of the wrong kind is given.
"""

from __future__ import annotations

import difflib
import enum
import re
import types
import typing
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from .durations import parse_duration
from .errors import ConfigError

__all__ = ["Duration", "Invalid", "Section", "convert", "join"]

T = TypeVar("T")


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the configuration structs: immutable, and an unknown key is an error."""

    # Fields a program fills in and a file may not set (the file a configuration
    # came from): refused as unknown keys, and never suggested.
    not_in_files: ClassVar[tuple[str, ...]] = ()


# A float field written in a file as 500ms, 5s, 1m, 1h30m or a bare number of
# seconds (shared/durations.py): ``heartbeat_interval: Duration = 5.0``. Read
# before msgspec sees the file, so a loaded value is a plain float like any other.
DURATION = msgspec.Meta(description="a duration such as 5s or 1m")
Duration = Annotated[float, DURATION]


class Invalid(ConfigError, ValueError):
    """A value a struct refuses, with its key relative to the struct (``""``: the
    struct as a whole, ``hcas[1]``: an element). A ``ConfigError`` for code that
    builds a struct directly; a ``ValueError`` so that msgspec, while reading a
    file, reports it with the struct's own place in the file."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key = key
        self.reason = reason


def join(where: str, key: str) -> str:
    """``health`` + ``heartbeat_interval``; ``fabrics`` + ``[0]``; ``""`` + ``tls``."""
    if not where:
        return key
    if not key:
        return where
    return f"{where}{key}" if key.startswith("[") else f"{where}.{key}"


def convert(data: Any, cls: type[T], source: str, *, at: str = "") -> T:
    """``data`` (as parsed from YAML) as a ``cls``, or a ``ConfigError`` naming
    ``source`` (the file), the key path (under ``at``) and what was expected."""
    plain = _seconds(_plain(data), cls, at, source)
    if isinstance(plain, dict):
        for key in getattr(cls, "not_in_files", ()):
            if key in plain:
                raise ConfigError(f"{source}: {join(at, key)}: {_unknown(key, _known(cls))}")
    try:
        return msgspec.convert(plain, cls, strict=True)
    except msgspec.ValidationError as e:
        key, reason = _explain(e, cls, data)
        raise ConfigError(f"{source}: {join(at, key) or 'top level'}: {reason}") from None


def _plain(value: Any) -> Any:
    """A copy without empty values (they mean "the default"), and with every key a
    string, so that ``1: x`` is refused as an unknown key like any other."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _seconds(data: Any, tp: Any, path: str, source: str) -> Any:
    """``data`` with the value of every ``Duration`` field in seconds, refusing
    one that is not a duration with its key path."""
    tp = _bare(tp)
    if isinstance(data, dict) and _is_struct(tp):
        out = dict(data)
        for f in msgspec.structs.fields(tp):
            if f.encode_name in out:
                key = join(path, f.encode_name)
                if typing.get_origin(f.type) is Annotated and DURATION in typing.get_args(f.type)[1:]:
                    out[f.encode_name] = parse_duration(out[f.encode_name], f"{source}: {key}")
                else:
                    out[f.encode_name] = _seconds(out[f.encode_name], f.type, key, source)
        return out
    if isinstance(data, list) and typing.get_origin(tp) in (list, tuple):
        inner = typing.get_args(tp)[0]
        return [_seconds(v, inner, f"{path}[{i}]", source) for i, v in enumerate(data)]
    return data


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


# What msgspec says, before " - at `$.path`".
_AT = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>.*)`", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<key>.*)`", re.S)
_WRONG = re.compile(r"Expected `(?P<expected>[^`]+)`.*, got `(?P<got>[^`]+)`", re.S)
_CHOICE = re.compile(r"Invalid enum value (?P<value>.*)", re.S)
_KINDS = {
    "int": "a whole number",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "object": "a mapping of keys",
    "array": "a list",
}
# The kinds of value, by msgspec's names for them.
_GOT = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "null": "nothing (null)",
    "array": "a list",
    "object": "a mapping",
}
_MSGSPEC_NAME = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}


def _explain(error: msgspec.ValidationError, cls: type, data: Any) -> tuple[str, str]:
    """(key path, what is wrong) for msgspec's ``error`` converting ``data`` (as
    written, empty values included) to ``cls``."""
    m = _AT.fullmatch(str(error))
    assert m is not None  # the pattern matches any text
    what, path = m["what"], (m["path"] or "").removeprefix(".")
    cause = error.__cause__
    if isinstance(cause, Invalid):
        return join(path, cause.key), cause.reason
    if u := _UNKNOWN.fullmatch(what):
        return join(path, u["key"]), _unknown(u["key"], _known(_type_at(cls, path)))
    if r := _MISSING.fullmatch(what):
        key = join(path, r["key"])
        return key, "required key has no value" if _value_at(data, key) is None else "required key is missing"
    if w := _WRONG.fullmatch(what):
        expected = _description(cls, path) or _KINDS.get(w["expected"], f"a {w['expected']}")
        value = _value_at(data, path)
        return path, f"expected {expected}, got {_GOT.get(w['got'], w['got']) if value is _MISSING_VALUE else _a(value)}"
    if c := _CHOICE.fullmatch(what):
        return path, f"{c['value']} is not one of {', '.join(_choices(_type_at(cls, path)))}"
    return path, what


def _choices(tp: Any) -> list[str]:
    if typing.get_origin(tp) is typing.Literal:
        return [str(c) for c in typing.get_args(tp)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [str(m.value) for m in tp]
    return []


def _unknown(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return f"unknown key (known keys here: {', '.join(known)})"


def _known(tp: Any) -> list[str]:
    if not _is_struct(tp):
        return []
    hidden = getattr(tp, "not_in_files", ())
    return [f.encode_name for f in msgspec.structs.fields(tp) if f.name not in hidden]


# One step of a path: ".name", "name" (the first), "[3]", or "[...]" (msgspec's
# word for a mapping's value: neither the key nor the value can be looked up).
_STEP = re.compile(r"\.?([^.\[\]]+)|\[(\d+|\.\.\.)\]")


def _field_type(cls: Any, path: str) -> Any:
    """The declared type at ``path`` inside ``cls`` (with any ``Annotated``), or None."""
    tp = cls
    for name, index in _STEP.findall(path):
        tp = _bare(tp)
        if name:
            if not _is_struct(tp):
                return None
            fields = {f.encode_name: f.type for f in msgspec.structs.fields(tp)}
            if name not in fields:
                return None
            tp = fields[name]
        else:
            args = typing.get_args(tp)  # list[X], tuple[X, ...], dict[K, X]
            tp = (args[-1] if index == "..." else args[0]) if args else None
    return tp


def _type_at(cls: Any, path: str) -> Any:
    return _bare(_field_type(cls, path))


def _bare(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and without ``| None``."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _bare(args[0])
    return tp


def _description(cls: Any, path: str) -> str | None:
    tp = _field_type(cls, path)
    if typing.get_origin(tp) is Annotated:
        for meta in typing.get_args(tp)[1:]:
            if isinstance(meta, msgspec.Meta) and meta.description:
                return meta.description
    return None


_MISSING_VALUE = object()


def _value_at(data: Any, path: str) -> Any:
    for name, index in _STEP.findall(path):
        if index == "...":
            return _MISSING_VALUE
        try:
            data = data[name] if name else data[int(index)]
        except (KeyError, IndexError, TypeError):
            return _MISSING_VALUE
    return data


def _a(value: Any) -> str:
    """A value as the message shows it: its kind, and itself when it is short."""
    kind = _GOT.get(_MSGSPEC_NAME.get(type(value), ""), type(value).__name__)
    if value is None or isinstance(value, (dict, list)):
        return kind
    text = repr(value)
    return f"{kind} {text}" if len(text) <= 60 else kind
