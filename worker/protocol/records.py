"""What every typed record and reply is: a dataclass written as one JSON object on one line and read
back with its typed parts checked against their annotations (a peer's wrong field is one ReplyError
naming it, never a KeyError later); the registries that map a line's kind to its class. Apart from
the records themselves, so each kind (events, messages, actions, replies) can live in a module of
its own and still be read by one parser."""

from __future__ import annotations

import dataclasses
import json
import time
import typing
from typing import TYPE_CHECKING, Any, ClassVar


def now() -> float:
    """The host's clock as every record is stamped with it (to the millisecond)."""
    return round(time.time(), 3)


class Record:
    """A typed record. Subclasses are dataclasses whose fields all have defaults, so a record read
    from an older or newer peer still parses: unknown keys are dropped, missing ones defaulted."""

    TAG: ClassVar[str] = "event"      # the key that names the record's kind
    KIND: ClassVar[str]

    if TYPE_CHECKING:     # every subclass is a dataclass: what dataclasses.fields() takes
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict:
        out: dict = {self.TAG: self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = _plain(value)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict):
        """The record of `d`; a field typed as a reply (a plan, GPU readings) is parsed and checked
        as one (ReplyError, a ValueError, where it is not)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for name, hint in _typed_parts(cls).items():
            if kw.get(name) is not None:
                kw[name] = _check(kw[name], hint, f"{cls.KIND}.{name}")
        return cls(**kw)


def _plain(value: Any) -> Any:
    """A field's value as JSON: typed parts (replies, records) as their dicts, within lists and
    dicts too (Record.to_dict and Reply.to_dict both)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_PARTS: dict[type, dict[str, Any]] = {}


def _typed_parts(cls: type) -> dict[str, Any]:
    """The fields of a record class whose type names a Reply (alone, optional or in a list)."""
    if cls not in _PARTS:
        def names_reply(hint: Any) -> bool:
            if isinstance(hint, type):
                return issubclass(hint, Reply)
            return any(names_reply(a) for a in typing.get_args(hint))
        hints = typing.get_type_hints(cls)
        _PARTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if names_reply(hints[f.name])}
    return _PARTS[cls]


EVENT_TYPES: dict[str, type[Record]] = {}
MESSAGE_TYPES: dict[str, type[Record]] = {}


def event(cls):
    EVENT_TYPES[cls.KIND] = cls
    return cls


def message(cls):
    MESSAGE_TYPES[cls.KIND] = cls
    return cls


# --- typed parts and replies (their checked parsing; the replies themselves: replies.py) -------------

class ReplyError(ValueError):
    """A reply whose JSON is not the record it should be (one line: which field, what it holds)."""


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` as the type `hint` says (nested replies parsed), or ReplyError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], where)
    if isinstance(hint, type) and issubclass(hint, Reply):
        return hint.from_dict(value, where)
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise ReplyError(f"{where}: a list expected, not {value!r:.80}")
        return [_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ReplyError(f"{where}: an object expected, not {value!r:.80}")
        return {k: _check(v, args[1], f"{where}.{k}") for k, v in value.items()} if args else value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ReplyError(f"{where}: {getattr(hint, '__name__', hint)} expected, not {value!r:.80}")
    return value


class Reply:
    """A typed reply (a dataclass). `to_dict` writes every field, None included, in declaration
    order; `from_dict` checks each field against its annotation."""

    if TYPE_CHECKING:     # every subclass is a dataclass: what dataclasses.fields() takes
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def from_dict(cls, d: Any, where: str | None = None):
        where = where or cls.__name__
        if not isinstance(d, dict):
            raise ReplyError(f"{where}: an object expected, not {d!r:.80}")
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _check(d[f.name], hints[f.name], f"{where}.{f.name}")
                      for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


class CompactReply(Reply):
    """A reply written without its unset (None) fields: a part that files keep and older readers
    compare key by key, where an absent key and a null one must read alike."""

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if v is not None}
