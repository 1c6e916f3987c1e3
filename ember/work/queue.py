"""The Celery app on the Redis broker, and its one queue.

Jobs and batch shards share the queue (and so a worker's threads): a worker serves
whichever message comes first, by message priority. Messages carry only an id; a task is
acknowledged late and rejected on worker loss, and the visibility timeout is set above
the longest attempt, so an unacknowledged message comes back only once its attempt can
no longer be running (its lease, ``ember.work.lease``, refuses a duplicate anyway).
"""

from __future__ import annotations

from typing import Any

from ember.config import Settings

QUEUE = "ember.jobs"
"""The name is historical (jobs came first): batch shards travel on it too."""


def broker_url(settings: Settings) -> str:
    """``EMBER_REDIS_URL``, else the data directory's local Redis that ``ember up``
    starts (its password and port, from the data directory)."""
    from ember.local import local_url

    return local_url(settings)


def make_celery(settings: Settings) -> Any:
    """A Celery app for ``settings`` (no connection is made until first use)."""
    from celery import Celery

    app = Celery("ember", set_as_current=False)
    app.conf.update(
        broker_url=broker_url(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=4,
        broker_transport_options={
            "visibility_timeout": settings.jobs_visibility_timeout_s,
            "priority_steps": list(range(10)),
            "sep": ":",
            "queue_order_strategy": "priority",
            "socket_connect_timeout": 4,
            "socket_timeout": 30,
            "health_check_interval": 10,
            "unacked_restore_interval": 10,
        },
        task_default_queue=QUEUE,
        task_default_priority=4,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_send_task_events=False,
        worker_enable_remote_control=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        enable_utc=True,
    )
    return app
