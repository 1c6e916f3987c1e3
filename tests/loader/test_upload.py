"""``ember.loader.upload``: a directory pushed to moto S3 (through a real proxy that counts
and breaks uploads) and to a file store, resumed after an interruption, and a killed or
interrupted ``ember models push`` resumed without sending its parts again."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import boto3
import pytest

from ember.api.app import create_app
from ember.config import Settings
from ember.domain.manifest import Manifest
from ember.errors import ArtifactError, StoreUnavailable
from ember.loader import upload
from ember.loader.stores import open_store
from ember.loader.upload import (
    MAX_PARTS,
    LocalFile,
    Push,
    check_local,
    digest_files,
    list_directory,
    part_bytes,
)
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.artifacts import raw_artifact, write_sharded
from tests.loader.conftest import FaultyProxy, _handler, s3_settings

MIB = 1024 * 1024
PART = 5 * MIB
EMBER = str(Path(sys.executable).with_name("ember"))


@dataclass
class UploadProxy(FaultyProxy):
    """The faulty proxy, also recording every request it forwards, and after
    ``fail_puts_after`` PUTs answering every PUT with a 500: the network going away in
    the middle of a push."""

    fail_puts_after: int | None = None
    puts: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)

    def next_fault(self, method: str, has_range: bool) -> str | None:
        if method != "PUT":
            return super().next_fault(method, has_range)
        with self.lock:
            self.puts += 1
            if self.fail_puts_after is not None and self.puts > self.fail_puts_after:
                return "500"
        return None

    def part_puts(self, since: int = 0) -> int:
        """Parts sent (``PUT ...?partNumber=``) from request ``since`` on."""
        with self.lock:
            return sum(1 for m, p in self.requests[since:] if m == "PUT" and "partNumber=" in p)


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[UploadProxy]:
    recorder = UploadProxy(moto_endpoint)
    base = _handler(recorder)

    class Recording(base):  # type: ignore[valid-type,misc]
        def _record(self) -> None:
            with recorder.lock:
                recorder.requests.append((self.command, self.path))
            base._forward(self)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _record

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    server.daemon_threads = True
    recorder.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield recorder
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def s3(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def write_random(path: Path, size: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(hashlib.shake_256(str(seed).encode()).digest(size))
    return path


def hashed(folder: Path) -> list[LocalFile]:
    return digest_files(list_directory(folder, max_files=100))


def uploads_in_progress(endpoint: str, bucket: str) -> list[dict[str, str]]:
    return s3(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def stored(endpoint: str, bucket: str, key: str) -> tuple[str, dict[str, str]]:
    obj = s3(endpoint).get_object(Bucket=bucket, Key=key)
    return hashlib.sha256(obj["Body"].read()).hexdigest(), obj["Metadata"]


# --- S3, in process ---------------------------------------------------------------------


@pytest.mark.s3
def test_an_interrupted_multipart_upload_resumes_without_resending_its_parts(
    tmp_path: Path, data_dir: Path, moto_endpoint: str, bucket: str, proxy: UploadProxy
) -> None:
    folder = tmp_path / "ckpt"
    big = write_random(folder / "model.safetensors", 4 * PART + 3 * MIB)  # 5 parts
    files = hashed(folder)
    settings = s3_settings(data_dir, proxy.url, s3_max_attempts=1, s3_max_concurrency=2)
    prefix = f"s3://{bucket}/artifacts/t/m/1"
    store = open_store(prefix + "/x", settings)
    state = tmp_path / "state"

    proxy.fail_puts_after = 2  # two parts get through, then the network fails
    first = Push(store, settings, state_dir=state)
    with pytest.raises(StoreUnavailable):
        first.run(files, prefix)
    assert first.report.parts_sent == 2 and first.report.uploaded == []
    assert len(uploads_in_progress(moto_endpoint, bucket)) == 1
    assert len(list(state.glob("*.json"))) == 1  # the upload is recorded

    proxy.fail_puts_after = None
    since = len(proxy.requests)
    second = Push(store, settings, state_dir=state)
    second.run(files, prefix)
    assert second.report.parts_kept == 2 and second.report.bytes_kept == 2 * PART
    assert second.report.parts_sent == 3 and proxy.part_puts(since) == 3  # 5 - 2 kept
    assert second.report.bytes_sent == big.stat().st_size - 2 * PART
    digest, meta = stored(moto_endpoint, bucket, "artifacts/t/m/1/model.safetensors")
    assert digest == files[0].sha256 and meta == {"sha256": files[0].sha256}
    assert uploads_in_progress(moto_endpoint, bucket) == []
    assert list(state.glob("*.json")) == []

    since = len(proxy.requests)
    third = Push(store, settings, state_dir=state)
    third.run(files, prefix)  # already there, same size and sha256: nothing is sent
    assert third.report.skipped == ["model.safetensors"] and third.report.bytes_sent == 0
    assert not any(m == "PUT" for m, _ in proxy.requests[since:])


@pytest.mark.s3
def test_a_kept_part_must_have_the_local_bytes_md5(
    tmp_path: Path, data_dir: Path, moto_endpoint: str, bucket: str, proxy: UploadProxy
) -> None:
    folder = tmp_path / "ckpt"
    write_random(folder / "model.safetensors", 2 * PART + MIB)  # 3 parts
    files = hashed(folder)
    settings = s3_settings(data_dir, proxy.url, s3_max_attempts=1, s3_max_concurrency=1)
    prefix = f"s3://{bucket}/artifacts/t/m/1"
    store = open_store(prefix + "/x", settings)
    proxy.fail_puts_after = 2
    with pytest.raises(StoreUnavailable):
        Push(store, settings, state_dir=tmp_path / "state").run(files, prefix)
    (upload,) = uploads_in_progress(moto_endpoint, bucket)
    # Part 1 in the store now holds other bytes of the same length.
    s3(moto_endpoint).upload_part(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"],
                                  PartNumber=1, Body=b"x" * PART)  # fmt: skip

    proxy.fail_puts_after = None
    since = len(proxy.requests)
    push = Push(store, settings, state_dir=tmp_path / "state")
    push.run(files, prefix)
    assert push.report.parts_kept == 1 and proxy.part_puts(since) == 2  # part 1 sent again
    assert stored(moto_endpoint, bucket, upload["Key"])[0] == files[0].sha256


@pytest.mark.s3
def test_stale_uploads_are_aborted_and_a_changed_file_starts_again(
    tmp_path: Path, data_dir: Path, moto_endpoint: str, bucket: str, proxy: UploadProxy
) -> None:
    folder = tmp_path / "ckpt"
    shard = write_random(folder / "model.safetensors", 2 * PART + MIB)
    write_random(folder / "config.json", 100)
    settings = s3_settings(data_dir, proxy.url, s3_max_attempts=1, s3_max_concurrency=1)
    prefix = f"s3://{bucket}/artifacts/t/m/1"
    store = open_store(prefix + "/x", settings)
    proxy.fail_puts_after = 1
    with pytest.raises(StoreUnavailable):
        Push(store, settings, state_dir=tmp_path / "state").run(hashed(folder), prefix)
    # A leftover of a push whose state is gone (another machine, a wiped cache).
    s3(moto_endpoint).create_multipart_upload(Bucket=bucket, Key="artifacts/t/m/1/config.json")
    assert len(uploads_in_progress(moto_endpoint, bucket)) == 2

    write_random(shard, 2 * PART + MIB, seed=1)  # changed since: its recorded upload is stale
    files = hashed(folder)
    proxy.fail_puts_after = None
    push = Push(store, settings, state_dir=tmp_path / "state")
    push.run(files, prefix)
    assert push.report.parts_kept == 0 and push.report.parts_sent == 3
    assert push.report.aborted_uploads == 2  # the shard's old upload and the leftover
    assert uploads_in_progress(moto_endpoint, bucket) == []
    for f in files:
        assert stored(moto_endpoint, bucket, f"artifacts/t/m/1/{f.path}")[0] == f.sha256


@pytest.mark.s3
def test_an_object_with_other_bytes_of_the_same_size_is_replaced(
    tmp_path: Path, data_dir: Path, moto_endpoint: str, bucket: str
) -> None:
    folder = tmp_path / "ckpt"
    write_random(folder / "model.safetensors", 1000)
    files = hashed(folder)
    key = "artifacts/t/m/1/model.safetensors"
    s3(moto_endpoint).put_object(Bucket=bucket, Key=key, Body=b"y" * 1000)  # no sha256
    settings = s3_settings(data_dir, moto_endpoint)
    prefix = f"s3://{bucket}/artifacts/t/m/1"
    push = Push(open_store(prefix + "/x", settings), settings, state_dir=tmp_path / "state")
    push.run(files, prefix)
    assert push.report.uploaded == ["model.safetensors"]
    assert stored(moto_endpoint, bucket, key) == (files[0].sha256, {"sha256": files[0].sha256})


# --- file:// ----------------------------------------------------------------------------


def test_a_file_store_push_skips_identical_files_and_replaces_others(
    tmp_path: Path, data_dir: Path
) -> None:
    folder = tmp_path / "ckpt"
    write_random(folder / "model.safetensors", 3 * MIB)
    write_random(folder / "tokenizer" / "vocab.txt", 10)
    files = hashed(folder)
    settings = Settings(data_dir=data_dir)
    prefix = settings.store_url + "/artifacts/t/m/1"
    store = open_store(prefix + "/x", settings)
    first = Push(store, settings, state_dir=tmp_path / "state")
    first.run(files, prefix)
    assert sorted(first.report.uploaded) == ["model.safetensors", "tokenizer/vocab.txt"]
    target = data_dir / "objects" / "artifacts" / "t" / "m" / "1"
    assert (target / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()

    raw = bytearray((target / "model.safetensors").read_bytes())
    raw[100] ^= 1  # same size, other bytes
    (target / "model.safetensors").write_bytes(raw)
    second = Push(store, settings, state_dir=tmp_path / "state")
    second.run(files, prefix)
    assert second.report.skipped == ["tokenizer/vocab.txt"]
    assert second.report.uploaded == ["model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()
    assert [p.name for p in target.iterdir() if p.name.startswith(".")] == []  # no temp file


# --- what a push takes ------------------------------------------------------------------


def test_a_directory_is_listed_as_the_registry_lists_it(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    write_random(folder / "model.safetensors", 10)
    write_random(folder / ".gitattributes", 10)
    write_random(folder / ".cache" / "huggingface" / "x.lock", 10)
    write_random(folder / "original" / "params.json", 10)
    (folder / "alias.json").symlink_to("original/params.json")  # inside: followed
    listed = list_directory(folder, max_files=100)
    assert [f.path for f in listed] == ["alias.json", "model.safetensors", "original/params.json"]
    assert listed[0].source == (folder / "original" / "params.json").resolve()

    secret = write_random(tmp_path / "credentials", 10)
    (folder / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is a link .* outside the directory"):
        list_directory(folder, max_files=100)
    (folder / "tokenizer.json").unlink()
    (folder / "more").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ArtifactError, match="more is a link to a directory"):
        list_directory(folder, max_files=100)


def test_a_bad_directory_is_refused_locally_with_the_registrys_reasons(tmp_path: Path) -> None:
    two = tmp_path / "two"
    write_sharded(two, {"a.safetensors": ["x"], "b.safetensors": ["y"]})
    (two / "model.safetensors.index.json").unlink()
    with pytest.raises(ArtifactError, match=r"2 top-level \.safetensors files and no"):
        check_local(list_directory(two, max_files=100), 1 << 20)

    wrong = tmp_path / "wrong"
    write_sharded(wrong, {"a.safetensors": ["x"], "b.safetensors": ["y"]},
                  index={"x": "b.safetensors", "y": "b.safetensors"})  # fmt: skip
    with pytest.raises(ArtifactError, match=r"tensor 'x' should be in b\.safetensors") as caught:
        check_local(list_directory(wrong, max_files=100), 1 << 20)
    assert caught.value.extra["tensor"] == "x"

    truncated = tmp_path / "truncated"
    write_sharded(truncated, {"a.safetensors": ["x"], "b.safetensors": ["y"]})
    raw = (truncated / "b.safetensors").read_bytes()
    (truncated / "b.safetensors").write_bytes(raw[:-8])
    with pytest.raises(ArtifactError, match=r"^b\.safetensors: ") as caught:
        check_local(list_directory(truncated, max_files=100), 1 << 20)
    assert caught.value.extra["file"] == "b.safetensors"

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "model.safetensors").write_bytes(raw_artifact(b"{" * 64, declared_len=1 << 40))
    with pytest.raises(ArtifactError, match=r"^model\.safetensors: "):
        check_local(list_directory(hostile, max_files=100), 1 << 20)


def test_a_large_files_digest_is_remembered_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload, "MEMO_MIN_BYTES", 0)  # every file counts as large here
    folder = tmp_path / "ckpt"
    shard = write_random(folder / "model.safetensors", MIB)
    cache = tmp_path / "cache"
    (first,) = digest_files(list_directory(folder, max_files=10), cache_dir=cache)
    assert first.sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()
    (memo,) = (cache / "digests").iterdir()
    doc = json.loads(memo.read_text())
    memo.write_text(json.dumps(doc | {"sha256": "0" * 64}))  # what a re-run would believe
    (again,) = digest_files(list_directory(folder, max_files=10), cache_dir=cache)
    assert again.sha256 == "0" * 64  # not hashed again: size, mtime, ctime, inode unchanged
    os.utime(shard, ns=(first.mtime_ns + 1, first.mtime_ns + 1))
    (changed,) = digest_files(list_directory(folder, max_files=10), cache_dir=cache)
    assert changed.sha256 == first.sha256  # hashed again


def test_a_part_size_that_needs_too_many_parts_grows() -> None:
    assert part_bytes(80 * MIB, 8 * MIB) == 8 * MIB
    size = 200 * 1024**3  # 200 GiB at 8 MiB would be 25 600 parts
    grown = part_bytes(size, 8 * MIB)
    assert grown % MIB == 0 and -(-size // grown) <= MAX_PARTS


# --- the command, killed and interrupted ------------------------------------------------


def cli_env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | base
    return env | {"COLUMNS": "200"}


def wait_for_parts(endpoint: str, bucket: str, at_least: int, proc: subprocess.Popen[str]) -> int:
    client = s3(endpoint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the push finished before it could be interrupted"
        listed = [client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                  for u in uploads_in_progress(endpoint, bucket)]  # fmt: skip
        parts = sum(len(p.get("Parts", [])) for p in listed)
        if parts >= at_least:
            return parts
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} parts reached the store")


@pytest.mark.s3
@pytest.mark.slow
def test_a_push_interrupted_then_killed_resumes_without_resending_parts(
    tmp_path: Path, data_dir: Path, moto_endpoint: str, bucket: str, proxy: UploadProxy
) -> None:
    folder = tmp_path / "ckpt"
    rows = (2 * PART + MIB) // 32  # each shard: 11 MiB of tensors, 3 parts of 5 MiB
    write_sharded(folder, {"model-00001-of-00002.safetensors": ["a"],
                           "model-00002-of-00002.safetensors": ["b"]}, rows=rows)  # fmt: skip
    store_url = f"s3://{bucket}/team"
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False,  # type: ignore[arg-type]
                        object_store_url=store_url, s3_endpoint_url=moto_endpoint)  # fmt: skip
    with services.serve_app(create_app(settings)) as url:
        env = cli_env({"EMBER_URL": url, "EMBER_API_KEY": ADMIN_KEY,
                       "EMBER_DATA_DIR": str(tmp_path / "client"),
                       "EMBER_OBJECT_STORE_URL": store_url,
                       "EMBER_S3_ENDPOINT_URL": proxy.url, "EMBER_S3_PART_SIZE_BYTES": str(PART),
                       "EMBER_S3_MAX_CONCURRENCY": "1",
                       "XDG_CACHE_HOME": str(tmp_path / "cache")})  # fmt: skip
        push = [EMBER, "models", "push", str(folder), "-n", "big", "-v", "1", "--engine", "torch",
                "--engine-config", '{"factory": "ember.engine.examples.mlp:mlp"}']  # fmt: skip
        proxy.delay_s = 0.3  # slow enough to stop in the middle

        interrupted = subprocess.Popen(push, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip
        wait_for_parts(moto_endpoint, bucket, 1, interrupted)
        interrupted.send_signal(signal.SIGINT)
        _, stderr = interrupted.communicate(timeout=60)
        assert interrupted.returncode == 130, stderr
        assert "interrupted" in stderr and "Run the same command again to resume" in stderr
        assert "nothing is registered" in stderr

        killed = subprocess.Popen(push, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
        before_kill = wait_for_parts(moto_endpoint, bucket, 3, killed)
        killed.kill()
        killed.wait(30)

        proxy.delay_s = 0
        since = len(proxy.requests)
        done = subprocess.run(push, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        kept = int(re.search(r"kept (\d+) parts of an interrupted upload", done.stderr)[1])  # type: ignore[index]
        assert kept >= before_kill >= 3
        assert proxy.part_puts(since) == 6 - kept  # only the parts not yet in the store
        row = json.loads(done.stdout)
    files = digest_files(list_directory(folder, max_files=100))
    assert row["status"] == "ready"
    assert row["artifact_uri"] == f"s3://{bucket}/team/artifacts/default/big/1/"
    assert row["sha256"] == Manifest.of(f.entry() for f in files).digest
    assert uploads_in_progress(moto_endpoint, bucket) == []
