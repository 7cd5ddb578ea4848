"""Example jobs for celery_ext: ``celery -A tasks worker`` runs them.

- ``send_notice``: a short job (weight 5: its queue is picked five times as often);
- ``build_report``: a long job that checks in with progress and stops cleanly when
  its worker shuts down or someone asks it to;
- ``sync_account``: a flaky job that retries with backoff and, when it keeps
  failing, ends in the dead set, from where a person can retry it;
- ``refresh_cache``: a unique job (a duplicate enqueued while one is pending is dropped);
- ``call_partner_api``: a rate-limited job (Celery's ``rate_limit``).
"""

from .app import app
from .jobs import build_report, call_partner_api, refresh_cache, send_notice, sync_account

__all__ = ["app", "build_report", "call_partner_api", "refresh_cache", "send_notice",
           "sync_account"]
