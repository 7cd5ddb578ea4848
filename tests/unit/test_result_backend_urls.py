"""The result backend's URL forms resolve through Celery's own lookup after
``import celery_ext``, and a bad one is refused in one line without its password (pure:
nothing connects)."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_ext  # noqa: F401 - registers the schemes
from celery_ext.config import ConfigError
from celery_ext.results import ResultBackend, TLSResultBackend


def backend_of(url: str, **options: object) -> ResultBackend:
    app = Celery(set_as_current=False, backend=url)
    app.conf.result_backend_transport_options = options
    backend = app.backend
    assert isinstance(backend, ResultBackend)
    return backend


def test_every_scheme_resolves_to_our_backend() -> None:
    assert type(backend_of("celery-ext://:pw@localhost:6379/1")) is ResultBackend
    tls = backend_of("celery-exts://localhost:6379/1?ssl_cert_reqs=required")
    assert type(tls) is TLSResultBackend
    # Celery hands "celery-ext+sentinel://..." over as "sentinel://...": put back together.
    url = "celery-ext+sentinel://:pw@h1:26379/1;celery-ext+sentinel://h2:26379/1"
    sentinel = backend_of(url, master_name="m")
    assert sentinel.url == url
    assert "pw" not in sentinel.as_uri() and sentinel.as_uri(include_password=True) == url
    assert backend_of("celery-ext://:pw@localhost:6379/1").expires == 24 * 3600


def test_a_result_expires_even_when_told_never() -> None:
    app = Celery(set_as_current=False, backend="celery-ext://localhost:6379/1")
    app.conf.result_expires = None
    assert app.backend.expires == 24 * 3600


@pytest.mark.parametrize(("url", "options", "says"), [
    ("celery-ext+sentinel://:s3cret@h1:26379/1", {}, "master_name"),
    ("celery-ext://:s3cret@h1:notaport/1", {}, "cannot read host:port"),
    ("celery-ext://:s3cret@h1:7000/2", {"cluster": True}, "only db 0"),
    ("celery-ext://:s3cret@h1:7000/0", {"cluster": "maybe"}, "true or"),
])
def test_bad_urls_say_what_to_change(url: str, options: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        backend_of(url, **options)
    message = str(err.value)
    assert says in message and "s3cret" not in message and "\n" not in message
    assert "broker" not in message


def test_global_keyprefix_goes_before_every_key_and_channel() -> None:
    backend = backend_of("celery-ext://localhost:6379/1", global_keyprefix="app1:")
    assert backend.get_key_for_task("t1") == "app1:{celery_ext:t1}:result"
    assert backend.keys.chord_keys("g")[0] == "app1:{celery_ext:g}:chord"
    assert backend.keys.pending_chords == "app1:{celery_ext}:pending_chords"
    assert backend.keys.wake_channel("oid").startswith("app1:{celery_ext:client:oid}")
