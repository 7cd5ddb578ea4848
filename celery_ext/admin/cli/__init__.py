"""``celery -A proj ext <command>``: look at and steer job queues, pools and the sets.

Registered through Celery's ``celery.commands`` entry point (``celery_ext.admin.cli:ext``).
Every command is made by :func:`~celery_ext.admin.cli.command.command`: it talks to
Redis through :class:`celery_ext.client.Client`, returns what to show, and the decorator
prints it as a table (``--json`` for scripts) or exits non-zero with a one-line error.
The commands live by topic: ``queues``, ``pools``, ``sets``, ``periodic``, ``servers``.
"""

from __future__ import annotations

import click
from celery.bin.base import handle_preload_options

from celery_ext.admin.cli import periodic, pools, queues, servers, sets

__all__ = ["ext"]


@click.group(name="ext")
@click.pass_context
@handle_preload_options
def ext(ctx: click.Context) -> None:
    """celery-ext: job queues, worker pools, busy workers, scheduled/retry/dead sets."""


for _topic in (queues, pools, sets, periodic, servers):
    for _command in _topic.COMMANDS:
        ext.add_command(_command)
