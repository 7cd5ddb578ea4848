"""The broker's memory policy: celery_ext needs Redis never to evict its keys.

Under an evicting ``maxmemory-policy`` (anything but ``noeviction``) Redis deletes
keys when it reaches ``maxmemory``: a job queue, a pool's in-flight record or the
dead set could vanish with the jobs in them, which no script can detect. Worker
pools warn about it once at start; under ``noeviction`` a full Redis refuses
writes instead, and producers get :class:`celery_ext.errors.BrokerOutOfMemory`.
"""

from __future__ import annotations

from typing import Any

from kombu.utils.encoding import bytes_to_str

#: The only policy under which Redis never drops a key to make room.
SAFE_POLICY = "noeviction"


def memory_policy(client: Any) -> tuple[str, int]:
    """``(maxmemory-policy, maxmemory bytes)`` from ``INFO memory`` (which works where
    ``CONFIG`` is disabled, as on managed services)."""
    info = client.info("memory")
    policy = bytes_to_str(info.get("maxmemory_policy", SAFE_POLICY))
    return str(policy), int(info.get("maxmemory", 0) or 0)


def eviction_warning(client: Any) -> str | None:
    """One line saying why an evicting policy loses jobs, or None under ``noeviction``."""
    policy, maxmemory = memory_policy(client)
    if policy == SAFE_POLICY:
        return None
    limit = f"maxmemory {maxmemory:,} bytes" if maxmemory else "maxmemory not set yet"
    return (f"celery_ext: the broker's maxmemory-policy is {policy} ({limit}): when full, "
            "Redis may evict job queues, in-flight records and the dead set, losing jobs "
            "without a trace; set maxmemory-policy noeviction")
