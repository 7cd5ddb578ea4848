"""``celery_ext.client.Client``: the public path of the read/admin API.

The code lives in :mod:`celery_ext.admin.client`, with the rest of the operator side.
"""

from celery_ext.admin.client import Client, InvalidPeriodicEntry

__all__ = ["Client", "InvalidPeriodicEntry"]
