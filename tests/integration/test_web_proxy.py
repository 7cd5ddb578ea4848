"""The dashboard behind a TLS-terminating proxy: ``celery ext web --forwarded-allow-ips``.

One test sends real forwarded headers from a client on 127.0.0.1 to a real ``ext web``
(uvicorn); the other runs the nginx block of docs/dashboard.md with Debian's nginx
(installed by tests/debian.py when missing) in front of it, over TLS.
"""

from __future__ import annotations

import datetime
import os
import re
import warnings
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from celery_ext.client import Client
from tests.apps import proj_web
from tests.debian import ensure_installed
from tests.webutil import free_port, run_cli, start_web, stop_all, wait_for
from tests.workers import REPO_ROOT, ManagedProcess

PUBLIC = "jobs.example.com"
NGINX = "/usr/sbin/nginx"


class _NoJar(DefaultCookiePolicy):
    """Keep no cookie: the servers here share 127.0.0.1 (a jar ignores ports), and each
    request says which cookie it sends."""

    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False


def _http(**options: Any) -> httpx.Client:
    return httpx.Client(cookies=CookieJar(policy=_NoJar()), timeout=10, **options)


def _session(client: httpx.Client, url: str, **headers: str) -> dict[str, str]:
    """The CSRF token and its cookie, as a browser holds them after loading a page."""
    r = client.get(f"{url}/api/csrf", headers=headers)
    assert r.status_code == 200, r.text
    token = r.json()["csrf_token"]
    return {**headers, "X-CSRF-Token": token, "Cookie": f"celery_ext_csrf={token}"}


def _pause(client: httpx.Client, url: str, **headers: str) -> httpx.Response:
    return client.post(f"{url}/api/queues/pause", json={"name": "q1"}, headers=headers)


def test_forwarded_headers_are_believed_only_from_the_named_proxies(
        broker_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    proj_web.configure(broker_url)
    ext = Client.for_app(proj_web.app)
    trusting, url = start_web(broker_url, tmp_path, "--forwarded-allow-ips", "127.0.0.1",
                              "--allowed-host", PUBLIC)
    plain, plain_url = start_web(broker_url, tmp_path)
    other, other_url = start_web(broker_url, tmp_path, "--forwarded-allow-ips", "10.9.8.7")
    forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": PUBLIC}
    try:
        with _http() as http:
            # The browser's action from the public origin works; the cookie is Secure
            # (the scheme is the forwarded one).
            r = http.get(f"{url}/api/csrf", headers=forwarded)
            assert "Secure" in r.headers["set-cookie"], r.headers
            session = _session(http, url, **forwarded)
            r = _pause(http, url, **session, Origin=f"https://{PUBLIC}")
            assert r.status_code == 200 and r.json()["paused"] is True, r.text
            assert ext.resume("q1") is True  # it really was paused
            # Other origins are still refused, and the Host check follows the forwarded host.
            r = _pause(http, url, **session, Origin="https://evil.example")
            assert r.status_code == 403, r.text
            r = _pause(http, url, **{**session, "X-Forwarded-Host": "rebind.example"},
                       Origin="https://rebind.example")
            assert r.status_code == 400, r.text
            # Without the forwarded headers, the public origin is not this one...
            session = _session(http, url)
            assert _pause(http, url, **session, Origin=f"https://{PUBLIC}").status_code == 403
            # ...and the direct loopback use is unchanged.
            assert _pause(http, url, **session, Origin=url).status_code == 200

            # No --forwarded-allow-ips, or a proxy at another address: the forwarded
            # headers are anyone's word, and the public origin's action is refused.
            for base in (plain_url, other_url):
                session = _session(http, base, **forwarded)
                r = _pause(http, base, **session, Origin=f"https://{PUBLIC}")
                assert r.status_code == 403, (base, r.text)
                assert "Secure" not in http.get(f"{base}/api/csrf",
                                                headers=forwarded).headers["set-cookie"]
    finally:
        stop_all([trusting, plain, other])

    bad = run_cli(broker_url, "web", "--forwarded-allow-ips", "10.0.0.300")
    assert bad.returncode == 2 and "'10.0.0.300' is not an IP address" in bad.stderr, bad.stderr


def _documented_nginx_block() -> str:
    text = (REPO_ROOT / "docs/dashboard.md").read_text()
    found = re.search(r"```nginx\n(.*?)```", text, re.S)
    assert found, "docs/dashboard.md has no nginx example"
    return found.group(1)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    crypto = pytest.importorskip("cryptography", reason="the TLS proxy test makes its "
                                 "certificate with the cryptography package")
    del crypto
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PUBLIC)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(PUBLIC)]), critical=False)
            .sign(key, hashes.SHA256()))
    pem, keyfile = directory / "cert.pem", directory / "cert.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return pem, keyfile


def _nginx_config(directory: Path, port: int, web_port: int) -> Path:
    """The documented server block on ``port`` with a test certificate, proxying to
    ``web_port``, inside a main config that keeps every file in ``directory``."""
    pem, key = _self_signed(directory)
    block = _documented_nginx_block()
    for old, new in (("listen 443 ssl", f"listen 127.0.0.1:{port} ssl"),
                     ("127.0.0.1:5040", f"127.0.0.1:{web_port}"),
                     ("/etc/ssl/jobs.example.com.pem", str(pem)),
                     ("/etc/ssl/jobs.example.com.key", str(key))):
        assert old in block, f"the documented nginx block lost {old!r}"
        block = block.replace(old, new)
    temp = "\n".join(f"    {kind}_temp_path {directory}/{kind};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    config = directory / "nginx.conf"
    config.write_text(f"""{user}daemon off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log off;
{temp}
{block}
}}
""")
    return config


def test_the_documented_nginx_example(broker_url: str, redis_client: redis.Redis,
                                      tmp_path: Path) -> None:
    try:
        nginx = ensure_installed("nginx", NGINX)
    except LookupError as exc:
        pytest.skip(str(exc))
    proj_web.configure(broker_url)
    ext = Client.for_app(proj_web.app)
    web_port, port = free_port(), free_port()
    # The documented command line, on a free port.
    web, _ = start_web(broker_url, tmp_path, "--root-path", "/jobs", "--forwarded-allow-ips",
                       "127.0.0.1", "--allowed-host", PUBLIC, port=web_port)
    proxy = ManagedProcess([nginx, "-e", "stderr", "-p", str(tmp_path), "-c",
                            str(_nginx_config(tmp_path, port, web_port))],
                           log_path=tmp_path / "nginx.log")
    public = f"https://{PUBLIC}:{port}"
    host = {"Host": f"{PUBLIC}:{port}"}
    try:
        proxy.start()
        with warnings.catch_warnings(), _http(verify=False) as http:
            warnings.simplefilter("ignore")
            base = f"https://127.0.0.1:{port}/jobs"

            def page() -> httpx.Response | None:
                try:
                    return http.get(f"{base}/queues", headers=host)
                except httpx.TransportError:
                    assert proxy.alive, proxy.log_text()
                    return None

            r = wait_for(page, what="the dashboard through nginx")
            assert r.status_code == 200 and "/jobs/static/" in r.text, r.text[:500]
            session = _session(http, base, **host)
            r = _pause(http, base, **session, Origin=public)
            assert r.status_code == 200, r.text
            assert ext.resume("q1") is True
            assert _pause(http, base, **session, Origin="https://evil.example").status_code \
                == 403
            r = http.get(f"{base}/api/queues", headers={"Host": f"rebind.example:{port}"})
            assert r.status_code == 400, r.text
    finally:
        stop_all([proxy, web])
