"""The Kombu transport: what Kombu calls in every process that uses ``celery-ext://``.

``celery_ext.transport:Transport`` is the class Kombu's URL schemes resolve to
(``TRANSPORT_ALIASES``); everything else in this package is how its channel fetches,
publishes and waits.
"""

from celery_ext.transport.channel import Channel, Transport

__all__ = ["Channel", "Transport"]
