"""The batch regime: cron schedules that score whole datasets, sharded and resumable.

- ``schemas``: the API's bodies and views, cron and time-zone validation.
- ``datasets``: input files (JSONL, CSV, Parquet) on ``file://`` and ``s3://``, globbing,
  and the Parquet output of a shard.
- ``plan``: a run is planned once: its version resolved and pinned, its input files
  listed and cut into shards.
- ``shards``: what a worker does with one shard message (claim, score, write, commit).
- ``beat``: ``ember beat``, which fires due schedules.

The machinery it shares with jobs (lease, failure classes, data-plane client, the Celery
app, version resolution) is ``ember.work``; this package never imports ``ember.jobs``.
"""
