"""``store.compact.parse``: the C decoder alone where Kombu's object hook would
change nothing, Kombu's ``loads`` where it would."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import dumps, loads

from celery_ext.store.compact import parse

#: JSON values, and the values Kombu's encoder writes as {"__type__", "__value__"}.
plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)
typed = (st.datetimes() | st.dates() | st.uuids()
         | st.decimals(allow_nan=False, allow_infinity=False).map(decimal.Decimal))
values = st.recursive(plain | typed,
                      lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20)


@given(st.dictionaries(st.text(), values, max_size=6))
def test_it_reads_what_kombus_loads_reads(message: dict[str, Any]) -> None:
    text = dumps(message)
    assert parse(text.encode()) == loads(text)
    assert parse(text) == loads(text)


def test_typed_values_come_back_as_values() -> None:
    when = datetime.datetime(2026, 11, 26, 10, 30, tzinfo=datetime.UTC)
    job = uuid.uuid4()
    got = parse(dumps({"headers": {"eta": when, "id": job}}).encode())
    assert got == {"headers": {"eta": when, "id": job}}
