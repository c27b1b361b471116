"""Keyset pagination, one way for every list: ``paginate(session, stmt, Keyset(...), limit=..., ...)``.

A list is ordered by a ``Keyset``: columns unique together, all ascending or all descending. A page is
the first ``limit`` rows after a key; one more row is read to tell whether there is more. The key comes
from an opaque cursor (``after`` of our own lists: a JSON list of the last row's key, base64url-encoded)
or, for the OpenAI-shaped lists whose ``after`` is an object id, from that object.
"""

from __future__ import annotations

import base64
import binascii
import json
import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Query
from sqlalchemy import ColumnElement, Select, TypeDecorator, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from api.errors import InvalidRequest
from rlrun.schemas import Page

T = TypeVar("T")
R = TypeVar("R")

# A cursor is never empty: the schema says so, so an empty `after=` is refused by the schema too.
AfterCursor = Annotated[
    str | None, Query(min_length=1, description="`next_cursor` of the previous page (omit for the first).")
]


def _not_a_cursor() -> InvalidRequest:
    return InvalidRequest("after: not a cursor returned by this API", field="after")


def encode_cursor(*key: Any) -> str:
    raw = json.dumps([str(k) if not isinstance(k, int | float) else k for k in key]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[Any]:
    """The sort key in ``cursor``; a cursor this API did not make is refused naming ``after``."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise _not_a_cursor() from None
    if not isinstance(key, list) or len(key) != arity:
        raise _not_a_cursor()
    # Ids and steps are 32-bit columns: a forged larger number would fail in the database, not here.
    if any(isinstance(v, int) and not -(2**31) <= v < 2**31 for v in key):
        raise _not_a_cursor()
    return key


def _python_type(column: InstrumentedAttribute[Any]) -> type:
    sql_type = column.type
    if isinstance(sql_type, TypeDecorator):  # UtcDateTime: the type it decorates says datetime
        sql_type = sql_type.impl
    python_type: type = sql_type.python_type
    return python_type


def _parse(value: Any, kind: type) -> Any:
    """A cursor's value read back as a ``kind`` column value; ValueError if it cannot be one."""
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is datetime:
        if isinstance(value, str):
            parsed = datetime.fromisoformat(value)
            if parsed.tzinfo is not None:  # our columns are aware UTC; a naive time was not ours
                return parsed
    elif kind is uuid.UUID:
        if isinstance(value, str):
            return uuid.UUID(value)
    raise ValueError(f"not a {kind.__name__}")


def _dump(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


class Keyset:
    """The sort key of one list: ``columns`` (unique together), all ascending or all ``desc``."""

    def __init__(self, *columns: InstrumentedAttribute[Any], desc: bool = False):
        self.columns = columns
        self.desc = desc
        self.types = [_python_type(c) for c in columns]

    def order_by(self) -> list[ColumnElement[Any]]:
        return [c.desc() if self.desc else c.asc() for c in self.columns]

    def after(self, key: Sequence[Any]) -> ColumnElement[bool]:
        """Rows that come after ``key``: ``(a, b) > (x, y)`` spelt ``a > x OR (a = x AND b > y)``."""
        beyond = operator.lt if self.desc else operator.gt
        return or_(
            *(
                and_(*(self.columns[j] == key[j] for j in range(i)), beyond(self.columns[i], key[i]))
                for i in range(len(self.columns))
            )
        )

    def key_of(self, row: Any) -> tuple[Any, ...]:
        return tuple(getattr(row, c.key) for c in self.columns)

    def encode(self, row: Any) -> str:
        """The cursor that starts the page after ``row``."""
        return encode_cursor(*(_dump(v) for v in self.key_of(row)))

    def decode(self, cursor: str) -> tuple[Any, ...]:
        """The key in a cursor made by ``encode``; any other cursor is refused naming ``after`` (422)."""
        values = decode_cursor(cursor, len(self.columns))
        try:
            return tuple(_parse(v, kind) for v, kind in zip(values, self.types, strict=True))
        except ValueError:
            raise _not_a_cursor() from None


@dataclass(frozen=True)
class Slice(Generic[T]):
    """One page's rows, whether more follow, and the cursor of the next page (None on the last)."""

    rows: list[T]
    has_more: bool
    next_cursor: str | None

    def as_page(self, read: Callable[[T], R]) -> Page[R]:
        """The API's page of these rows, each turned into its response model by ``read``."""
        return Page(
            data=[read(row) for row in self.rows], has_more=self.has_more, next_cursor=self.next_cursor
        )


def paginate(
    session: Session,
    stmt: Select[T],
    keyset: Keyset,
    *,
    limit: int,
    cursor: str | None = None,
    after: Sequence[Any] | None = None,
) -> Slice[T]:
    """The rows of ``stmt`` (filtered, not ordered) in ``keyset`` order, at most ``limit``, after the
    key in ``cursor`` (an opaque cursor from ``Slice.next_cursor``) or the key ``after``."""
    if cursor is not None:
        after = keyset.decode(cursor)
    stmt = stmt.order_by(*keyset.order_by()).limit(limit + 1)
    if after is not None:
        stmt = stmt.where(keyset.after(after))
    rows = list(session.scalars(stmt))
    more = len(rows) > limit
    rows = rows[:limit]
    return Slice(rows=rows, has_more=more, next_cursor=keyset.encode(rows[-1]) if more else None)
