"""``bulk_jobs.argsrepr``: the ``argsrepr``/``kwargsrepr`` headers of ``apply_many``'s
jobs are what Celery's ``saferepr`` writes (a pure function: compared on many values)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from celery.utils.saferepr import saferepr

from celery_ext.producer.bulk_jobs import argsrepr

ODD_STRINGS = ["", "plain", "it's", 'say "hi"', "back\\slash", "new\nline", "tab\t", "é",
               "日本", "\x00", "a" * 300, "'", "\u2028"]
SCALARS: list[Any] = [0, -1, 10**40, 1.5, float("inf"), float("nan"), True, False, None,
                      *ODD_STRINGS]


def values(rng: random.Random) -> Any:
    items = [rng.choice(SCALARS) for _ in range(rng.randint(0, 6))]
    kind = rng.choice(["tuple", "list", "dict", "nested", "other"])
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    if kind == "dict":
        return {str(rng.choice(ODD_STRINGS)) + str(i): v for i, v in enumerate(items)}
    if kind == "nested":
        return (items, {"k": tuple(items)}, [[items]])
    return rng.choice([b"bytes", {1, 2}, object, 3j])


@pytest.mark.parametrize("maxsize", [1024, 64, 8])
def test_argsrepr_is_celerys_saferepr(maxsize: int) -> None:
    rng = random.Random(maxsize)
    for _ in range(3000):
        value = values(rng)
        assert argsrepr(value, maxsize, 3) == saferepr(value, maxsize, maxlevels=3), value


def test_argsrepr_at_the_length_limit() -> None:
    for n in range(1, 40):
        value = ("x" * n,)
        for maxsize in range(1, 50):
            assert argsrepr(value, maxsize, 3) == saferepr(value, maxsize, maxlevels=3)
