"""What a ``-P gevent`` worker needs that gevent's monkey-patching left out.

``celery worker -P gevent`` patches the standard library first thing
(``celery.maybe_patch_concurrency`` -> ``gevent.monkey.patch_all``). While gevent patches
``threading`` it walks every live object to replace existing locks, which touches
Celery's lazy module proxies; they import ``celery._state`` -> ``celery.utils`` ->
``kombu.utils``, and ``kombu.utils.functional`` binds ``from time import sleep`` before
gevent has patched ``time``. That ``sleep`` is the blocking one, and it is the sleep of
``retry_over_time``: the wait between the consumer's reconnect attempts ("Trying again
in 2.00 seconds...") and between a publish's retries. Under gevent it stops the whole
process, every job's greenlet and the heartbeat's with it, for the length of the
backoff: a cut of half a second froze a pool for 2 s, its jobs finished seconds late and
a ``dead_after`` of 2 s had the live pool reaped (the ``connection_cut_gevent`` fault
scenario).
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("celery_ext.worker.green")


def cooperative_retry_sleep() -> bool:
    """Under gevent's patching, make Kombu's retry sleep gevent's (it yields to the other
    greenlets); returns whether it had to. A process gevent did not patch is left alone:
    there a blocking sleep blocks one thread, as it should."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None or not monkey.is_module_patched("time"):
        return False
    from kombu.utils import functional

    if functional.sleep is not monkey.get_original("time", "sleep"):
        return False
    functional.sleep = time.sleep  # gevent's, now that ``time`` is patched
    logger.debug("celery_ext: Kombu's retry sleep made cooperative under gevent")
    return True
