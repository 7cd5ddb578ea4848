"""The dashboard's JSON API and pages, through Starlette's test client, against a live
Redis and a real worker (``tests.apps.proj_web``)."""

from __future__ import annotations

import base64
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.config import Settings
from tests.apps import proj_web
from tests.webutil import wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

XSS = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">"


@pytest.fixture
def api(ext_client: Client) -> Iterator[TestClient]:
    app = create_app(ext_client, sample_interval=0.2)
    with TestClient(app) as tc:
        yield tc


def csrf(tc: TestClient) -> dict[str, str]:
    token = tc.get("/api/csrf").json()["csrf_token"]
    return {"X-CSRF-Token": token}


def flag(key: str) -> None:
    redis.Redis.from_url(proj_web.backend_url(proj_web.app.conf.broker_url, db=2)).set(key, 1)


def start_worker(worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return worker_factory(proj_web.__name__, concurrency=2).start()


def test_pages_and_api_against_a_live_worker(
        api: TestClient, ext_client: Client,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    start_worker(worker_factory)
    for i in range(3):
        proj_web.echo.delay(i)
    dead_job = proj_web.fragile.delay("k-dead", XSS)
    scheduled = proj_web.echo.apply_async(("later",), countdown=300)
    proj_web.flaky.delay("k-retry", 300)
    running = proj_web.progress.delay(200, 0.1)
    wait_for(lambda: ext_client.counts() == {"scheduled": 1, "retry": 1, "dead": 1},
             what="one job in each set")
    wait_for(lambda: ext_client.busy_workers(), what="a busy worker")

    # Every page renders (the shell; app.js fills it from the API).
    for path, title in [("/", "Overview"), ("/queues", "Job queues"), ("/pools", "Worker pools"),
                        ("/busy", "Busy workers"), ("/scheduled", "Scheduled"),
                        ("/retry", "Retry"), ("/dead", "Dead set"), ("/demo", "widget")]:
        r = api.get(path)
        assert r.status_code == 200, path
        assert title in r.text
        assert 'name="csrf-token"' in r.text

    overview = wait_for(lambda: (lambda d: d if len(d["series"]["t"]) >= 2 else None)(
        api.get("/api/overview").json()), what="two overview samples")
    counts = overview["counts"]
    assert counts["dead"] == 1 and counts["scheduled"] == 1 and counts["retry"] == 1
    assert counts["busy"] == 1 and counts["live_pools"] == 1
    # Counters are summed in each executing process and written once a second.
    overview = wait_for(lambda: (lambda d: d if d["totals"]["processed"] >= 3 else None)(
        api.get("/api/overview").json()), what="the processed counter")
    assert set(overview["series"]) >= {"t", "processed_rate", "queued", "dead"}

    queues = api.get("/api/queues", params={"prefix": "tests.apps.proj_web."}).json()
    names = {q["name"] for q in queues["items"]}
    assert {"tests.apps.proj_web.echo", "tests.apps.proj_web.fragile"} <= names
    assert queues["total"] == len(queues["items"])
    assert api.get("/api/queues", params={"limit": 1}).json()["items"].__len__() == 1

    pools = api.get("/api/pools").json()["items"]
    assert len(pools) == 1 and pools[0]["state"] == "running"

    busy = api.get("/api/busy").json()["items"]
    assert busy[0]["job_id"] == running.id and busy[0]["job_name"] == "tests.apps.proj_web.progress"

    sched = api.get("/api/scheduled").json()
    assert sched["total"] == 1 and sched["items"][0]["task_id"] == scheduled.id
    retry = api.get("/api/retry").json()
    assert retry["total"] == 1 and retry["items"][0]["attempt"] == 1

    dead = api.get("/api/dead").json()
    assert dead["total"] == 1
    item = dead["items"][0]
    assert item["task_id"] == dead_job.id and item["args"] == ["k-dead", XSS]
    assert "traceback" not in item and "payload" not in item  # list views stay light
    detail = api.get(f"/api/dead/{item['id']}").json()
    assert "RuntimeError" in detail["traceback"]
    assert api.get("/api/dead/nope").status_code == 404

    # The server-rendered dead job page escapes job data.
    page = api.get(f"/dead/{item['id']}").text
    assert "<script>window.__pwned" not in page and "<img src=x" not in page
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page

    # Actions: POST with the CSRF token.
    headers = csrf(api)
    r = api.post("/api/queues/pause", json={"name": "tests.apps.proj_web.echo"}, headers=headers)
    assert r.status_code == 200 and r.json()["changed"] is True
    echo = next(q for q in api.get("/api/queues").json()["items"]
                if q["name"] == "tests.apps.proj_web.echo")
    assert echo["paused"] is True
    assert api.post("/api/queues/resume", json={"name": "tests.apps.proj_web.echo"},
                    headers=headers).json()["changed"] is True

    r = api.post("/api/busy/stop", json={"job_id": running.id}, headers=headers)
    assert r.status_code == 200
    r = api.post("/api/busy/stop", json={"job_id": "no-such-job"}, headers=headers)
    assert r.status_code == 404 and "in flight" in r.json()["error"]
    assert running.get(timeout=20)["stopped_at"] < 200

    sched_id = sched["items"][0]["id"]
    r = api.post("/api/scheduled/delete", json={"id": sched_id}, headers=headers)
    assert r.status_code == 200
    assert api.post("/api/scheduled/delete", json={"id": sched_id},
                    headers=headers).status_code == 404
    assert api.get("/api/scheduled").json()["total"] == 0

    flag("k-dead")
    r = api.post("/api/dead/retry", json={"ids": [item["id"]]}, headers=headers)
    assert r.json() == {"retried": [item["id"]], "count": 1}
    # The same job id runs again and succeeds.
    meta = wait_for(lambda: (lambda m: m if m["status"] == "SUCCESS" else None)(
        proj_web.app.backend.get_task_meta(dead_job.id, cache=False)), what="retried job")
    assert meta["result"] == "ok k-dead"
    assert api.post("/api/dead/retry", json={"ids": [item["id"]]},
                    headers=headers).status_code == 404  # already retried
    assert api.get("/api/dead").json()["total"] == 0

    proj_web.fragile.delay("k-dead-2")
    proj_web.fragile.delay("k-dead-3")
    wait_for(lambda: ext_client.counts()["dead"] == 2, what="two dead jobs")
    assert api.post("/api/dead/delete", json={"all": True}, headers=headers).json() == {"count": 2}
    assert api.post("/api/dead/delete", json={"ids": "nope"}, headers=headers).status_code == 404
    assert api.post("/api/dead/retry", json={}, headers=headers).status_code == 400
    assert api.post("/api/queues/pause", content=b"[", headers=headers).status_code == 400


def _events(tc: TestClient, job_id: str) -> list[dict[str, Any]]:
    out = []
    with tc.stream("GET", f"/api/jobs/{job_id}/events") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "status":
                out.append(json.loads(line.split(":", 1)[1]))
    return out


def test_job_status_and_event_stream(api: TestClient, ext_client: Client,
                                     worker_factory: Callable[..., WorkerProcess]) -> None:
    unknown = api.get("/api/jobs/no-such-job").json()
    assert unknown["state"] == "queued" and unknown["done"] is False

    later = proj_web.echo.apply_async((1,), countdown=300)
    st = wait_for(lambda: (lambda s: s if s["state"] == "scheduled" else None)(
        api.get(f"/api/jobs/{later.id}").json()), what="scheduled status")
    assert st["due_at"] and st["job_name"] == "tests.apps.proj_web.echo"

    queued = proj_web.echo.delay(2)  # no worker yet
    assert api.get(f"/api/jobs/{queued.id}").json()["state"] == "queued"

    start_worker(worker_factory)
    job = proj_web.progress.delay(6, 0.3)
    events = _events(api, job.id)
    states = [e["state"] for e in events]
    assert states[-1] == "succeeded" and events[-1]["done"] is True
    assert events[-1]["result"] == repr({"steps": 6})
    assert events[-1]["job_name"] == "tests.apps.proj_web.progress"
    running = [e for e in events if e["state"] == "running"]
    assert running, states
    progress = [e["progress"] for e in running if e["progress"] is not None]
    assert progress and all(0 < p <= 1 for p in progress), running
    assert any(e["message"] and e["message"].startswith("step ") for e in running)
    assert api.get(f"/api/jobs/{job.id}").json()["state"] == "succeeded"
    assert queued.get(timeout=10) == 2

    bad = proj_web.fragile.delay("never")
    events = _events(api, bad.id)
    assert events[-1]["state"] == "dead" and events[-1]["dead_id"]
    assert "never is not ready" in events[-1]["error"]


def test_security(ext_client: Client) -> None:
    # Open dashboard: reads are free, writes need the CSRF token and a same-origin request.
    with TestClient(create_app(ext_client)) as tc:
        r = tc.get("/")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY"
        cookie = r.headers["set-cookie"]
        assert "celery_ext_csrf=" in cookie and "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        token = re.search(r'name="csrf-token" content="([^"]+)"', r.text)
        assert token is not None
        body = {"name": "q1"}
        assert tc.post("/api/queues/pause", json=body).status_code == 403
        assert tc.post("/api/queues/pause", json=body,
                       headers={"X-CSRF-Token": "wrong" * 8}).status_code == 403
        good = {"X-CSRF-Token": token.group(1)}
        assert tc.post("/api/queues/pause", json=body,
                       headers={**good, "Origin": "http://evil.example"}).status_code == 403
        assert tc.post("/api/queues/pause", json=body,
                       headers={**good, "Sec-Fetch-Site": "cross-site"}).status_code == 403
        assert tc.post("/api/queues/pause", json=body,
                       headers={**good, "Origin": "http://testserver"}).status_code == 200
        assert tc.get("/api/queues/pause").status_code == 405  # no GET for actions

    # Token auth: bearer for scripts (no CSRF needed), ?token= once for browsers.
    with TestClient(create_app(ext_client, token="s3cret")) as tc:
        assert tc.get("/api/queues").status_code == 401
        assert tc.get("/static/job-widget.js").status_code == 200  # static files are public
        assert tc.get("/api/queues", headers={"Authorization": "Bearer nope"}).status_code == 401
        bearer = {"Authorization": "Bearer s3cret"}
        assert tc.get("/api/queues", headers=bearer).status_code == 200
        assert tc.post("/api/queues/resume", json={"name": "q1"}, headers=bearer).status_code \
            == 200
        r = tc.get("/queues?token=s3cret", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/queues"
        assert "celery_ext_auth=" in r.headers["set-cookie"]
        assert tc.get("/api/queues").status_code == 200  # the cookie now
        assert tc.post("/api/queues/pause", json={"name": "q1"}).status_code == 403  # no CSRF

    # Basic auth.
    with TestClient(create_app(ext_client, basic_auth="admin:pw")) as tc:
        r = tc.get("/")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
        auth = "Basic " + base64.b64encode(b"admin:pw").decode()
        assert tc.get("/", headers={"Authorization": auth}).status_code == 200
        wrong = "Basic " + base64.b64encode(b"admin:nope").decode()
        assert tc.get("/", headers={"Authorization": wrong}).status_code == 401

    # Host check against DNS rebinding (what `ext web` sets up on loopback).
    with TestClient(create_app(ext_client, allowed_hosts={"127.0.0.1"}),
                    base_url="http://127.0.0.1") as tc:
        assert tc.get("/").status_code == 200
        assert tc.get("/", headers={"Host": "rebind.example"}).status_code == 400

    # Cross-origin reads of the widget API only for allowed origins.
    with TestClient(create_app(ext_client, allow_origins=["http://shop.example"])) as tc:
        r = tc.get("/api/jobs/x", headers={"Origin": "http://shop.example"})
        assert r.headers["access-control-allow-origin"] == "http://shop.example"
        r = tc.get("/api/queues", headers={"Origin": "http://shop.example"})
        assert "access-control-allow-origin" not in r.headers
        r = tc.get("/api/jobs/x", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_non_ascii_credentials_are_refused_like_any_wrong_one(ext_client: Client) -> None:
    with TestClient(create_app(ext_client, token="s3cret", basic_auth="admin:pw")) as tc:
        for user, password in (("é", "pw"), ("admin", "pé"), ("€", "€")):
            auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            r = tc.get("/api/queues", headers={"Authorization": auth})
            assert r.status_code == 401, (user, password, r.text)
        r = tc.get("/queues?token=%C3%A9", follow_redirects=False)
        assert r.status_code == 401, r.text
        # Raw UTF-8 bytes where the base64 belongs: a wrong credential, not a 500.
        for raw in ("admin:p\u00e9".encode(), "\u00e9".encode(), b"\xff\xfe=="):
            r = tc.get("/api/queues", headers={"Authorization": b"Basic " + raw})
            assert r.status_code == 401, (raw, r.text)
        r = tc.get("/api/queues", headers={"Authorization": "Bearer s3cr\u00e9t".encode(
            "latin-1")})
        assert r.status_code == 401, r.text
        r = tc.get("/api/queues", headers={"Cookie": "celery_ext_auth=\u00e9".encode()})
        assert r.status_code == 401, r.text
        # Signed in, a non-ASCII CSRF token is a wrong one: 403.
        auth = "Basic " + base64.b64encode(b"admin:pw").decode()
        r = tc.post("/api/queues/pause", json={"name": "q1"},
                    headers={"Authorization": auth, "X-CSRF-Token": "\u00e9".encode("latin-1")})
        assert r.status_code == 403, r.text
    # A non-ASCII secret works as given (user and password are UTF-8 in basic auth).
    with TestClient(create_app(ext_client, basic_auth="jos\u00e9:p\u00e4ss")) as tc:
        auth = "Basic " + base64.b64encode("jos\u00e9:p\u00e4ss".encode()).decode()
        assert tc.get("/api/queues", headers={"Authorization": auth}).status_code == 200
        auth = "Basic " + base64.b64encode("jos\u00e9:pass".encode()).decode()
        assert tc.get("/api/queues", headers={"Authorization": auth}).status_code == 401


def test_redis_down_is_a_503(tmp_path: Path) -> None:
    down = Client(redis.Redis(port=1, socket_connect_timeout=0.5), Settings())
    with TestClient(create_app(down)) as tc:
        r = tc.get("/api/queues")
        assert r.status_code == 503 and "Redis unavailable" in r.json()["error"]
        assert tc.get("/").status_code == 200  # the page shell loads and shows the error


def test_paging_parameters_are_bounded_and_only_outages_are_503(
        api: TestClient, ext_client: Client) -> None:
    for query, name in (("offset=99999999999999999999", "offset"), ("offset=-1", "offset"),
                        ("offset=1.5", "offset"), ("limit=0", "limit"),
                        ("limit=1001", "limit"), ("limit=ten", "limit")):
        for path in ("/api/dead", "/api/queues", "/api/scheduled", "/api/retry"):
            r = api.get(f"{path}?{query}")
            assert r.status_code == 400 and repr(name) in r.json()["error"], (path, query, r.text)
    r = api.get("/api/dead/search?name=x&limit=99999999999999999999")
    assert r.status_code == 400 and "'limit'" in r.json()["error"], r.text
    page = api.get(f"/api/dead?offset={2**53 - 1}&limit=1000").json()
    assert page["items"] == [] and page["offset"] == 2**53 - 1
    # Redis answering with an error is not an outage: a 500 that says what Redis said.
    ext_client.client.set(ext_client.keys.dead, "not a sorted set")
    r = api.get("/api/dead")
    assert r.status_code == 500 and "WRONGTYPE" in r.json()["error"], r.text


def test_no_html_injection_sinks_in_scripts() -> None:
    static = Path(proj_web.__file__).resolve().parents[2] / "celery_ext/admin/web/static"
    for js in static.glob("*.js"):
        code = re.sub(r"/\*.*?\*/", "", js.read_text(), flags=re.S)
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in code, f"{js.name} uses {sink}"


def test_web_command_warns_when_exposed_without_auth(
        ext_client: Client, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import uvicorn

    from celery_ext.admin.web import serve

    served: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append({"app": app, **kw}))
    with caplog.at_level("WARNING", logger="celery_ext.admin.web"):
        serve(ext_client, host="0.0.0.0", port=5999)
    assert "without authentication" in caplog.text and served[0]["host"] == "0.0.0.0"
    caplog.clear()
    with caplog.at_level("WARNING", logger="celery_ext.admin.web"):
        serve(ext_client, host="0.0.0.0", port=5999, token="t")
        serve(ext_client, host="127.0.0.1", port=5999)
    assert "without authentication" not in caplog.text
    # On loopback only loopback Host headers are accepted (DNS rebinding).
    with TestClient(served[-1]["app"], base_url="http://127.0.0.1:5999") as tc:
        assert tc.get("/api/health").json()["ok"] is True
        assert tc.get("/api/health", headers={"Host": "evil.example:5999"}).status_code == 400
