"""Bodies and views of the batch API, and cron / time-zone validation."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ember.errors import StoreAccessDenied
from ember.loader.stores import parse_location
from ember.registry.schemas import NAME_PATTERN

RUN_ID_PATTERN = r"^br_[0-9a-f]{24}$"
CatchUp = Literal["skip", "latest", "all"]
MAX_CATCH_UP_RUNS = 50


class BatchSpec(BaseModel):
    """What a run scores and where it writes."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(
        max_length=127,
        description="`name` (the deployment's production version), `name:alias` or "
        "`name:version`; resolved once when a run starts and pinned for all its shards.",
    )
    input_uri: str = Field(
        min_length=8,
        max_length=2048,
        description="file:// or s3:// URI; `{date}` becomes the run's date (YYYY-MM-DD, in "
        "the schedule's zone); `*` and `[...]` match many files. A tenant key: under its "
        "tenant's prefix (`<object store>/batch/<tenant>/`).",
    )
    output_uri: str = Field(
        min_length=8,
        max_length=1024,
        description="Prefix for the output: `<prefix>/<run id>/part-NNNNN.parquet`, "
        "`rejects/part-NNNNN.jsonl` and `_manifest.json`. `{date}` is replaced too. No `?`, "
        "`#` or `..`; a tenant key: under its tenant's prefix, as `input_uri`.",
    )
    format: Literal["auto", "jsonl", "csv", "parquet"] = "auto"
    input_column: str = Field("features", min_length=1, max_length=255)
    key_columns: list[str] = Field(
        default_factory=lambda: ["id"], max_length=32, description="Copied to the output."
    )
    shard_rows: int = Field(10_000, ge=1, le=1_000_000)
    max_parallel_shards: int = Field(4, ge=1, le=1024)
    deadline_s: float | None = Field(
        None,
        gt=0,
        le=7 * 86_400,
        description="A run not finished this long after it "
        "started fails (its remaining shards are not scored).",
    )
    max_error_ratio: float = Field(
        0.01, ge=0, le=1, description="Rejected rows a shard tolerates (fraction)."
    )

    @field_validator("input_uri", "output_uri")
    @classmethod
    def _scheme(cls, value: str) -> str:
        """Parsed as the stores will read it (``parse_location``), ``{date}`` filled in:
        no ``?`` or ``#`` (a part of the URI a store drops: every part would land on one
        object, or outside the prefix), no ``.``, ``..`` or empty segment, encoded or not."""
        if not value.startswith(("file://", "s3://")):
            raise ValueError("must be a file:// or s3:// URI")
        if "?" in value:
            raise ValueError("must not contain '?' (a URI query; match one character with [...])")
        try:
            parse_location(value.replace("{date}", "2000-01-01"))
        except StoreAccessDenied as exc:
            raise ValueError(exc.detail) from exc
        return value

    @field_validator("key_columns")
    @classmethod
    def _keys(cls, value: list[str]) -> list[str]:
        if any(not k or len(k) > 255 for k in value) or len(set(value)) != len(value):
            raise ValueError("key columns must be distinct, 1-255 characters")
        reserved = {"model", "version", "artifact_sha256", "scored_at", "prediction"}
        if clash := reserved & set(value):
            raise ValueError(f"{sorted(clash)} are output columns")
        return value


class ScheduleCreate(BatchSpec):
    name: str = Field(pattern=NAME_PATTERN, max_length=63)
    cron: str = Field(max_length=255, description="5-field cron, e.g. `0 2 * * *`.")
    timezone: str = Field("UTC", max_length=64, description="IANA zone, e.g. Europe/Paris.")
    catch_up: CatchUp = Field(
        "latest",
        description="Fire times missed while no beat ran: `skip` them, run the `latest` "
        f"only, or run `all` (at most {MAX_CATCH_UP_RUNS}).",
    )
    paused: bool = False

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        zone(value)
        return value

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        check_cron(value)
        return value


class RunCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schedule: str | None = Field(None, pattern=NAME_PATTERN, max_length=63)
    spec: BatchSpec | None = None
    date: str | None = Field(
        None, pattern=r"^\d{4}-\d{2}-\d{2}$", description="`{date}` (default: today, UTC)."
    )


def zone(name: str) -> ZoneInfo:
    try:
        if not name or name.startswith(("/", ".")) or ".." in name:
            raise ValueError
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"unknown IANA time zone {name!r} (e.g. UTC, Europe/Paris)") from exc


def check_cron(expr: str) -> None:
    from croniter import croniter

    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(
            f"cron expression {expr!r} must have 5 fields (minute hour day month weekday)"
        )
    if not croniter.is_valid(expr):
        raise ValueError(f"invalid cron expression {expr!r}")
    try:
        next_fire(expr, "UTC", datetime.now(UTC))
    except Exception as exc:  # croniter: CroniterBadDateError (e.g. 30 February)
        raise ValueError(f"cron expression {expr!r} never fires") from exc


def _iter_fires(expr: str, tz: str, after: datetime) -> Iterator[datetime]:
    """Fire times after ``after`` (UTC), computed in the zone ``tz``: a 02:30 daily
    schedule stays at 02:30 local time across DST; a wall-clock time that a spring-forward
    skips fires once at the jump (croniter); one that a fall-back repeats fires once
    (the first time), as classic cron does."""
    from croniter import croniter

    local = after.astimezone(zone(tz))
    it = croniter(expr, local)
    last_wall = local.replace(tzinfo=None)
    for _ in range(100_000):
        nxt: datetime = it.get_next(datetime)
        wall = nxt.replace(tzinfo=None)
        if wall <= last_wall:  # the repeated hour of a fall-back
            continue
        last_wall = wall
        yield nxt.astimezone(UTC)


def fire_times(expr: str, tz: str, after: datetime, until: datetime, limit: int) -> list[datetime]:
    """Fire times in ``(after, until]`` (UTC), at most ``limit``."""
    out: list[datetime] = []
    for t in _iter_fires(expr, tz, after):
        if t > until or len(out) >= limit:
            break
        out.append(t)
    return out


def next_fire(expr: str, tz: str, after: datetime) -> datetime:
    for t in _iter_fires(expr, tz, after):
        return t
    raise ValueError(f"cron expression {expr!r} never fires")


class ShardError(BaseModel):
    shard: int
    input_uri: str
    rows: str
    attempts: int
    error: str


class Progress(BaseModel):
    shards_done: int
    shards_total: int
    shards_failed: int
    rows_total: int
    rows_scored: int
    rows_rejected: int
    rows_per_s: float | None
    eta_s: float | None


class RunPublic(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    id: str
    schedule: str | None
    fire_at: datetime | None
    status: str
    model: str
    version: str
    artifact_sha256: str
    input_uri: str
    output_uri: str
    progress: Progress
    shard_errors: list[ShardError]
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    deadline_at: datetime | None


class SchedulePublic(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    name: str
    cron: str
    timezone: str
    catch_up: str
    paused: bool
    spec: dict[str, Any]
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    created_at: datetime
