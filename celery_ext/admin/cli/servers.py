"""Commands that serve until stopped: the dashboard (``web``) and the Prometheus
metrics alone (``metrics``)."""

from __future__ import annotations

import logging

import click

from celery_ext.admin.cli.command import ClientGetter, command


@command("web", json_option=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=5040, show_default=True, type=int, help="Port to listen on.")
@click.option("--token", envvar="CELERY_EXT_WEB_TOKEN", default=None,
              help="Require this bearer token (env CELERY_EXT_WEB_TOKEN). "
                   "Browsers: open /?token=... once.")
@click.option("--basic-auth", envvar="CELERY_EXT_WEB_BASIC_AUTH", default=None,
              metavar="USER:PASSWORD",
              help="Require HTTP basic auth (env CELERY_EXT_WEB_BASIC_AUTH).")
@click.option("--allow-origin", "allow_origins", multiple=True,
              help="Let pages on this origin read /api/jobs/... (the embeddable widget).")
@click.option("--root-path", default="", help="URL prefix when served behind a proxy.")
@click.option("--forwarded-allow-ips", envvar="FORWARDED_ALLOW_IPS", default=None,
              metavar="IPS",
              help="Comma-separated proxy IPs or networks (or *) whose X-Forwarded-Proto, "
                   "-Host and -For headers are believed (env FORWARDED_ALLOW_IPS).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also accept this Host (or forwarded host), e.g. the proxy's public name; "
                   "given, only these (and loopback names on a loopback bind) are accepted.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def web(client: ClientGetter, host: str, port: int, token: str | None, basic_auth: str | None,
        allow_origins: tuple[str, ...], root_path: str, forwarded_allow_ips: str | None,
        allowed_hosts: tuple[str, ...], log_level: str) -> None:
    """Serve the dashboard and its JSON API (default http://127.0.0.1:5040/)."""
    try:
        from celery_ext.admin.web import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs its extra: pip install 'celery-ext[web]' ({exc})") from None
    if basic_auth is not None and ":" not in basic_auth:
        raise click.BadParameter("expected USER:PASSWORD", param_hint="--basic-auth")
    if forwarded_allow_ips:
        from celery_ext.admin.web.forwarded import parse_trusted

        try:
            parse_trusted(forwarded_allow_ips)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--forwarded-allow-ips") from None
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(message)s")
    c = client()
    c.ping()
    try:
        serve(c, host=host, port=port, token=token, basic_auth=basic_auth,
              allow_origins=allow_origins, log_level=log_level, root_path=root_path,
              forwarded_allow_ips=forwarded_allow_ips,
              allowed_hosts=tuple(h.lower() for h in allowed_hosts))
    except OSError as exc:
        raise click.ClickException(exc.strerror or str(exc)) from None


@command("metrics", json_option=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=5041, show_default=True, type=int, help="Port to listen on.")
def metrics(client: ClientGetter, host: str, port: int) -> None:
    """Serve only the Prometheus metrics, at /metrics (no dashboard, no authentication:
    bind a private address; the dashboard's /metrics sits behind its token)."""
    try:
        from prometheus_client import start_http_server

        from celery_ext.admin.metrics import registry_for
    except ImportError as exc:
        raise click.ClickException(
            f"metrics need their extra: pip install 'celery-ext[metrics]' ({exc})") from None
    c = client()
    c.ping()
    server, thread = start_http_server(port, addr=host, registry=registry_for(c))
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"celery_ext metrics on http://{shown}:{port}/metrics", err=True)
    try:
        while thread.is_alive():
            thread.join(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


COMMANDS = [web, metrics]
