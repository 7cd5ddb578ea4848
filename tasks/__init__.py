"""The example app under its short name in a checkout: ``celery -A tasks worker``.

The app and its jobs live in the package, :mod:`celery_ext.demo.app`, so that the
wheel carries them and ``python -m celery_ext.demo`` runs from any folder; this name
keeps the checkout's commands (README, docs/cli.md, compose/) short. Job names are the
package's (``celery_ext.demo.app.send_notice``, ...).
"""

from celery_ext.demo.app import (
    app,
    build_report,
    call_partner_api,
    purge_sessions,
    refresh_cache,
    send_notice,
    sync_account,
)

__all__ = ["app", "build_report", "call_partner_api", "purge_sessions", "refresh_cache",
           "send_notice", "sync_account"]
