"""celery_ext: Celery on Redis/Valkey as a real job system.

Importing this package registers the ``celery-ext://`` (and ``celery-exts://``,
TLS, and their ``+sentinel`` forms) URL schemes with Kombu (the broker) and Celery (the
result backend, ``celery_ext.results``), and does nothing else. ``install(app)`` adds
the job-system defaults: one job queue per task name, weighted round-robin, jobs owned
until finished. Flower support is asked for where Flower runs
(:func:`celery_ext.admin.flower.enable`, one line in Flower's config).
"""

from __future__ import annotations

from celery.app.backends import BACKEND_ALIASES
from kombu.transport import TRANSPORT_ALIASES

from celery_ext.config import OUR_SCHEMES, SCHEME, TLS_SCHEME, unreadable_scheme
from celery_ext.errors import Throttled
from celery_ext.install import install
from celery_ext.producer.bulk import apply_many, bulk
from celery_ext.worker.cursor import Interrupted
from celery_ext.worker.observer import checkin

__version__ = "0.1.0"

#: Import path of the transport class, for ``broker_transport`` (see README).
TRANSPORT = "celery_ext.transport:Transport"

for _scheme in OUR_SCHEMES:
    # (Kombu itself reads "celery-ext+sentinel://h" as transport "celery-ext"; the
    # full scheme is looked up when it fails over to another sentinel URL.)
    TRANSPORT_ALIASES.setdefault(_scheme, TRANSPORT)

#: Result backend class per scheme: Celery reads "celery-ext+sentinel://h" as backend
#: "celery-ext" with URL "sentinel://h", which the backend puts back together.
_BACKENDS = {SCHEME: "celery_ext.results:ResultBackend",
             TLS_SCHEME: "celery_ext.results:TLSResultBackend"}
for _scheme, _backend in _BACKENDS.items():
    BACKEND_ALIASES.setdefault(_scheme, _backend)


def _unreadable_scheme() -> str:
    """Kombu looks up transport "" when urlparse reads no scheme in a URL
    (``celery_ext://``) and calls a callable alias: say why, not "No such transport: "."""
    raise KeyError(f"No such transport: {unreadable_scheme()}")


TRANSPORT_ALIASES.setdefault("", _unreadable_scheme)

__all__ = ["SCHEME", "TLS_SCHEME", "TRANSPORT", "Interrupted", "Throttled", "__version__",
           "apply_many", "bulk", "checkin", "install"]
