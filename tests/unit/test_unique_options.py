"""The unique task options checked at worker start and at publish: one line naming the
task and the value (pure functions: no server)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_ext.options.unique import (
    UNTIL_FINISHED,
    UNTIL_STARTED,
    finished_lock,
    lock_value,
    unique_mode,
    validate_unique_options,
)


def task(**options: Any) -> Any:
    return SimpleNamespace(**{"name": "t", "acks_late": True, **options})


@pytest.mark.parametrize(("unique", "mode"), [
    (False, None), (None, None), (True, UNTIL_STARTED), ("until_started", UNTIL_STARTED),
    ("until_finished", UNTIL_FINISHED)])
def test_unique_values_and_their_modes(unique: Any, mode: str | None) -> None:
    assert unique_mode(task(unique=unique)) == mode
    validate_unique_options(task(unique=unique))


@pytest.mark.parametrize(("options", "message"), [
    ({"unique": "until_done"}, "task 't' has unique='until_done'; it must be True, "
                               "'until_started' or 'until_finished'"),
    ({"unique": UNTIL_FINISHED, "acks_late": False},
     "task 't' has unique='until_finished' without acks_late; set acks_late=True"),
    ({"unique": True, "debounce": 0}, "task 't' has debounce=0; it must be a number of "
                                      "seconds > 0"),
    ({"unique": True, "debounce": True}, "task 't' has debounce=True"),
    ({"debounce": 1.0}, "task 't' has debounce=1.0 without unique; set unique=True"),
])
def test_bad_unique_options_are_one_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_unique_options(task(**options))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lock_value_carries_the_tag_only_until_finished() -> None:
    assert lock_value(UNTIL_STARTED, "id1", "tag1") == "id1"
    assert lock_value(UNTIL_FINISHED, "id1", "tag1") == "id1\ntag1"
    assert finished_lock({"celery_ext_unique": "n:abc",
                          "celery_ext_unique_mode": UNTIL_FINISHED}) == "n:abc"
    assert finished_lock({"celery_ext_unique": "n:abc"}) is None
    assert finished_lock(None) is None
