"""The script loader pastes only the helpers a script uses, and every script loads."""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable

import redis

from celery_ext.store import scripts

FRAGMENT = """\
-- a fragment
local SEP = ':'
local function a(x)
  return x .. SEP
end
-- b calls a
local function b(x)
  if x then
    return a(x)
  end
end
local function c(x)
  return x
end
"""


def _defined(text: str) -> list[str]:
    return re.findall(r"^local function (\w+)\(", text, re.MULTILINE)


def test_only_used_helpers_are_kept_with_what_they_call_in_their_order() -> None:
    assert _defined(scripts.used_helpers(FRAGMENT, "return b(ARGV[1])")) == ["a", "b"]
    assert _defined(scripts.used_helpers(FRAGMENT, "return c(1)")) == ["c"]
    assert _defined(scripts.used_helpers(FRAGMENT, "return 1")) == []
    kept = scripts.used_helpers(FRAGMENT, "return a(1) .. c(2)")
    assert _defined(kept) == ["a", "c"]
    assert "local SEP = ':'" in kept  # what is not a helper is always kept


def test_a_name_inside_another_word_does_not_keep_a_helper() -> None:
    assert _defined(scripts.used_helpers(FRAGMENT, "local abc = 1 return abc")) == []


def test_every_script_loads_and_calls_only_helpers_it_defines(
        redis_client: redis.Redis) -> None:
    for name in scripts.SCRIPT_NAMES:
        text = scripts.source(name)
        redis_client.script_load(text)  # a missing helper would be a compile-time global
        defined = set(_defined(text))
        fragments = "".join(path.read_text() for path in _fragment_files())
        for helper in _defined(fragments):
            if re.search(rf"\b{helper}\(", text.replace(f"local function {helper}(", "")):
                assert helper in defined, (name, helper)


def _fragment_files() -> list[Traversable]:
    folder = resources.files("celery_ext.store").joinpath("lua", "include")
    return [p for p in folder.iterdir() if p.name.endswith(".lua")]
