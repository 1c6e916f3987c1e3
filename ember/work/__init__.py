"""What the async jobs (``ember.jobs``) and the batch runs (``ember.batch``) share.

Both are Celery workers that take a row of the registry for a while, call the gateway's
data plane, and write their outcome fenced on the row's lease. The shared machinery lives
here, so neither package imports the other (and this one imports neither):

    lease.py      claim / heartbeat / fenced commit on a row with a lease token
    failures.py   transient / shed / permanent / lost / rejected, under ``EmberError``
    client.py     the keep-alive HTTP client to the data plane (``http.client``)
    queue.py      the Celery app and its queue (Redis broker)
    versions.py   which deployment and version a ``model[:version]`` reference means
    instances.py  the check of instances against a version's ``input_schema``
    process.py    the worker processes' plumbing: schema wait, parent watch, supervisor
"""
