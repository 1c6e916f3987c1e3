"""The async regime: submit a job, come back for the result.

The registry row (``ember.registry.tables.Job``) is the source of truth; Redis, through
Celery, only delivers job ids to workers. A worker *claims* a job with a conditional
UPDATE that sets a fresh lease token, renews the lease while it runs, calls the
gateway's data plane over HTTP at the ``async`` priority (never the router directly),
and writes the result with an UPDATE fenced on its token — so a redelivered message, a
worker that was presumed dead, or a cancelled job can never produce a second result.
The machinery it shares with batch runs (lease, failure classes, data-plane client, the
Celery app) is ``ember.work``; this package never imports ``ember.batch``.

    queue.py      task names, publishing (the Celery app is ``ember.work.queue``)
    records.py    every state change of a job, as fenced conditional UPDATEs
    submit.py     what the API does: validate, resolve the version, idempotency, quota
    schemas.py    the API's wire schemas and a job's public document
    runner.py     what a worker does with one job (chunks, retries, results)
    results.py    results inline or in the object store; ``input_uri`` reading
    webhooks.py   HMAC-signed deliveries with SSRF checks
    sweeper.py    re-publishes lost messages, takes over expired leases, purges results
    worker.py     ``ember worker`` (and the supervised worker of ``ember up``)
    demand.py     queued async work per deployment, for the autoscaler
"""
