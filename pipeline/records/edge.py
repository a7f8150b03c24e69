"""The one converter between records and the JSON that crosses a task or pod edge.

An Airflow task's return value (XCom) and a step pod's result file carry the same JSON: a
record's `model_dump_json` (strict JSON: an infinite rate is the string "Infinity"), decoded.
`call` runs an entry function from a DAG task: each argument its signature types as a record
is read from that JSON, and the record it returns is written back to it, so the task holds
no field names and the function sees only records.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pipeline.core.errors import ReleaseError

R = TypeVar("R", bound=BaseModel)
Json = Any  # a record's JSON form, as XCom or a pod's result file carries it (decoded)


def to_json(value: Any) -> Json:
    """A record (or a list of them) as strict JSON, decoded; plain JSON values pass through."""
    if isinstance(value, BaseModel):
        return json.loads(value.model_dump_json())
    if isinstance(value, list):
        return [to_json(item) for item in value]
    return value


def from_json(cls: type[R], value: Json | str | bytes, where: str = "") -> R:
    """`value` (a record's JSON, decoded or as text) as `cls`; a ReleaseError naming the record, the
    field and `where` it came from when it does not fit."""
    if isinstance(value, cls):
        return value
    text = value if isinstance(value, (str, bytes)) else json.dumps(value)
    try:
        return cls.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(whole)'}: {e['msg']}" for e in exc.errors())
        raise ReleaseError(f"{where or 'input'}: not a {cls.__name__}: {problems}") from None


def _record_type(hint: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the record class a parameter takes, whether as a list of them); (None, False) for plain values.
    In a union (`X | None`, `ReleaseRef | int`) the one record class it names."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [t for t in map(_record_type, args) if t[0] is not None]
        return found[0] if len(found) == 1 else (None, False)
    if typing.get_origin(hint) is list and args:
        inner, _ = _record_type(args[0])
        return inner, inner is not None
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint, False
    return None, False


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Json:
    """`fn(*args, **kwargs)` with every argument its signature types as a record (or a list of
    them) read from JSON, and its result written as JSON: what a DAG task runs."""
    hints = typing.get_type_hints(fn)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    for name, value in bound.arguments.items():
        cls, many = _record_type(hints.get(name))
        if cls is None or not isinstance(value, (dict, list, str, bytes, BaseModel)):
            continue  # a plain value where the hint allows one (`ReleaseRef | int`), or None
        where = f"{fn.__name__}({name})"
        bound.arguments[name] = [from_json(cls, v, where) for v in value] if many else from_json(cls, value, where)
    return to_json(fn(*bound.args, **bound.kwargs))
