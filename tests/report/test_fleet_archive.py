"""A fleet's archive in object storage: ``mta archive upload`` into a real S3-compatible server on 127.0.0.1
(moto, tests/support/s3_server.py), and ``mta report`` reading it back, against the same segments read locally.

The upload tests take a second each; the two Spark tests share the report tests' session.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from typing import Any

import attrs
import pytest
import report_reference as ref
import s3_server
from click.testing import CliRunner, Result
from spark_fixture import run_relay

from mta.archive.upload import CHECKSUM_KEY, Sent, archived, upload_directory
from mta.cli import main
from mta.report.text import render_text
from spool.export.rows import ERROR_TYPE, plan, relay_name_for, segment_rows

pytestmark = pytest.mark.timeout(1800)  # the Spark tests may be the first to start the shared session

@pytest.fixture(scope="module")
def relays(fleet: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three relays' spools with archives: the report tests' mx1 and mx2, and mx3."""
    d = str(tmp_path_factory.mktemp("fleet3") / "mx3")
    run_relay(d, 3, messages=60, hours=2.0)
    return {**fleet, "mx3": d}


@pytest.fixture(name="bucket")
def bucket_fixture(s3_endpoint: str) -> str:
    """A new, empty bucket of the test's own."""
    name = f"fleet-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


def config_file(tmp_path: Any, spool_dir: str, *, archive: bool = True, hostname: str = "") -> str:
    path = tmp_path / f"relay-{uuid.uuid4().hex[:8]}.toml"
    lines = ["[spool]", f'dir = "{spool_dir}"']
    if archive:
        lines.append(f'archive_dir = "{os.path.join(spool_dir, "archive")}"')
    if hostname:
        lines += ["[server]", f'hostname = "{hostname}"']
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def upload(config: str, url: str, *args: str) -> Result:
    """``mta archive upload`` as a cron line runs it."""
    return CliRunner().invoke(main, ["archive", "upload", "--config", config, url, *args], prog_name="mta")


def objects(bucket: str, prefix: str = "") -> dict[str, tuple[int, str]]:
    """Key -> (size, SHA-256 of its bytes) of every object in ``bucket``, read back by boto3."""
    s3 = s3_server.client()
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            out[o["Key"]] = (len(body), hashlib.sha256(body).hexdigest())
    return out


def local_archive(spool_dir: str, relay: str) -> dict[str, tuple[int, str]]:
    out = {}
    for _seg, path in archived(os.path.join(spool_dir, "archive")):
        with open(path, "rb") as f:
            data = f.read()
        out[f"{relay}/{os.path.basename(path)}"] = (len(data), hashlib.sha256(data).hexdigest())
    return out


# -- mta archive upload ------------------------------------------------------------------------------------


def test_upload_puts_each_relay_under_its_name_and_a_second_run_sends_nothing(
        relays: dict[str, str], bucket: str, tmp_path: Any) -> None:
    want: dict[str, tuple[int, str]] = {}
    for relay, d in relays.items():
        result = upload(config_file(tmp_path, d), f"s3://{bucket}/archive", "--relay", relay)
        n = len(archived(os.path.join(d, "archive")))
        assert result.exit_code == 0, result.output
        assert result.output.splitlines()[-1] == \
            f"mta archive upload: {n} uploaded, 0 already there, to s3://{bucket}/archive/{relay}/"
        want.update({f"archive/{k}": v for k, v in local_archive(d, relay).items()})
    assert objects(bucket) == want
    s3 = s3_server.client()
    some = min(want)
    assert s3.head_object(Bucket=bucket, Key=some)["Metadata"][CHECKSUM_KEY] == want[some][1]
    stamps = {k: s3.head_object(Bucket=bucket, Key=k)["LastModified"] for k in want}

    for relay, d in relays.items():
        again = upload(config_file(tmp_path, d), f"s3://{bucket}/archive", "--relay", relay)
        n = len(archived(os.path.join(d, "archive")))
        assert again.exit_code == 0
        assert again.output == f"mta archive upload: 0 uploaded, {n} already there, to s3://{bucket}/archive/{relay}/\n"
    assert {k: s3.head_object(Bucket=bucket, Key=k)["LastModified"] for k in want} == stamps
    quiet = upload(config_file(tmp_path, relays["mx1"]), f"s3://{bucket}/archive", "--relay", "mx1", "--quiet")
    assert (quiet.exit_code, quiet.output) == (0, "")


def test_a_changed_object_is_uploaded_again(relays: dict[str, str], bucket: str, tmp_path: Any) -> None:
    d = relays["mx2"]
    config = config_file(tmp_path, d)
    assert upload(config, f"s3://{bucket}", "--relay", "mx2").exit_code == 0
    keys = sorted(objects(bucket))
    s3 = s3_server.client()
    same_size, cut = keys[2], keys[5]
    body = bytearray(s3.get_object(Bucket=bucket, Key=same_size)["Body"].read())
    body[100] ^= 0xFF  # one flipped byte, the size unchanged: overwritten by something else, no checksum of ours
    s3.put_object(Bucket=bucket, Key=same_size, Body=bytes(body))
    body = s3.get_object(Bucket=bucket, Key=cut)["Body"].read()
    s3.put_object(Bucket=bucket, Key=cut, Body=body[: len(body) // 2],  # a partial copy that claims the checksum
                  Metadata={CHECKSUM_KEY: hashlib.sha256(body).hexdigest()})

    result = upload(config, f"s3://{bucket}", "--relay", "mx2")
    assert result.exit_code == 0, result.output
    assert sorted(result.output.splitlines()[:-1]) == sorted(
        f"replaced s3://{bucket}/{k} ({local_archive(d, 'mx2')[k][0]} bytes)" for k in (same_size, cut))
    assert objects(bucket) == local_archive(d, "mx2")


def test_the_default_relay_name_is_the_hostname_and_a_file_url_gets_whole_files(
        relays: dict[str, str], tmp_path: Any) -> None:
    d = relays["mx1"]
    target = tmp_path / "fleet"
    config = config_file(tmp_path, d, hostname="mx9.example")
    first = upload(config, f"file://{target}")
    assert first.exit_code == 0, first.output
    names = sorted(os.listdir(target / "mx9.example"))
    assert names == sorted(os.path.basename(p) for _s, p in archived(os.path.join(d, "archive")))  # no .part left
    victim = target / "mx9.example" / names[1]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")  # same size, other bytes: found by hashing it back
    again = upload(config, f"file://{target}")
    assert again.output.splitlines() == [
        f"replaced file://{victim} ({victim.stat().st_size} bytes)",
        f"mta archive upload: 1 uploaded, {len(names) - 1} already there, to file://{target}/mx9.example/"]
    with open(os.path.join(d, "archive", names[1]), "rb") as f:
        assert victim.read_bytes() == f.read()


@pytest.mark.parametrize(("url", "relay", "line"), [
    ("s3://b", "../up", "mta: --relay '../up': a relay name is letters, digits, '.', '_' and '-' (not starting with "
                        "'.' or '-'), as in a host name"),
    ("nosuch://x", "mx1", "mta: nosuch://x/mx1: unknown URL scheme nosuch://"),
])
def test_upload_mistakes_are_one_line_exit_2(relays: dict[str, str], tmp_path: Any, url: str, relay: str,
                                             line: str) -> None:
    result = upload(config_file(tmp_path, relays["mx1"]), url, "--relay", relay)
    assert (result.exit_code, result.output) == (2, line + "\n")


def test_without_an_archive_dir_there_is_nothing_to_upload(relays: dict[str, str], tmp_path: Any) -> None:
    config = config_file(tmp_path, relays["mx1"], archive=False)
    result = upload(config, "s3://b", "--relay", "mx1")
    assert result.exit_code == 2
    assert result.output == f"mta: {config}: spool.archive_dir: not set: the relay deletes its garbage segments, " \
                            "so there is nothing to upload (set [spool] archive_dir)\n"


def test_a_store_that_refuses_is_one_line_exit_1(relays: dict[str, str], s3_endpoint: str, tmp_path: Any) -> None:
    result = upload(config_file(tmp_path, relays["mx1"]), "s3://no-such-bucket-here/archive", "--relay", "mx1")
    assert result.exit_code == 1
    first = min(archived(os.path.join(relays["mx1"], "archive")))[1]
    assert result.output.startswith(f"mta: {first} -> s3://no-such-bucket-here/archive/mx1/"), result.output
    assert result.output.rstrip().endswith("(0 segments uploaded before it; the next run goes on from there)")
    assert len(result.output.splitlines()) == 1


# -- the report's listing and its reads, without Spark --------------------------------------------------------


def test_a_job_that_lists_while_an_upload_runs_sees_whole_segments_and_no_gap(
        relays: dict[str, str], bucket: str) -> None:
    d = os.path.join(relays["mx1"], "archive")
    url = f"s3://{bucket}/mx1"
    seen: list[tuple[int, list[Any]]] = []

    def list_and_read(sent: Sent) -> None:
        """The report's driver lists, and its tasks read, between two segments of the upload."""
        tasks = plan([f"s3://{bucket}/*"])
        seen.append((len(tasks), [r["error"] for t in tasks for r in segment_rows(t, "mx1") if r["error"]]))

    # An upload of the next segment is in progress the whole time (a multipart upload, as s3fs sends a
    # large segment): S3 shows an object only once it is complete.
    s3 = s3_server.client()
    pending = s3.create_multipart_upload(Bucket=bucket, Key="mx1/00000000000fffff.seg")
    s3.upload_part(Bucket=bucket, Key="mx1/00000000000fffff.seg", UploadId=pending["UploadId"], PartNumber=1,
                   Body=b"\0" * (5 * 1024 * 1024))
    sent = upload_directory(d, url, list_and_read)
    assert [s.action for s in sent] == ["uploaded"] * len(archived(d))
    assert seen == [(k, []) for k in range(1, len(sent) + 1)]


def test_a_listed_object_that_is_gone_or_in_cold_storage_is_named(relays: dict[str, str], bucket: str) -> None:
    d = os.path.join(relays["mx1"], "archive")
    upload_directory(d, f"s3://{bucket}/mx1")
    tasks = plan([f"s3://{bucket}/mx1"])
    gone, cold = tasks[1], tasks[3]
    s3 = s3_server.client()
    s3.delete_object(Bucket=bucket, Key=f"mx1/{os.path.basename(gone.path)}")
    key = f"mx1/{os.path.basename(cold.path)}"  # a lifecycle rule moved it to Glacier
    s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")
    errors = {t.path: [r["error"] for r in segment_rows(t, "mx1") if r["rtype"] == ERROR_TYPE] for t in tasks}
    assert errors[gone.path] == [f"missing segment: segment {gone.segment} was listed but is not there to read"]
    (cold_error,) = errors[cold.path]
    assert cold_error.startswith(f"unreadable: segment {cold.segment} cannot be read: "), cold_error
    assert "storage class" in cold_error
    assert all(not e for p, e in errors.items() if p not in (gone.path, cold.path))


# -- the report on Spark ------------------------------------------------------------------------------------


def test_spark_reads_a_fleet_in_s3_as_the_same_archives_read_locally(
        spark: Any, relays: dict[str, str], bucket: str, tmp_path: Any) -> None:
    for relay, d in relays.items():
        assert upload(config_file(tmp_path, d), f"s3://{bucket}", "--relay", relay).exit_code == 0
    df = spark.read.format("logspool").load([f"s3://{bucket}/*"])
    assert df.rdd.getNumPartitions() == sum(len(archived(os.path.join(d, "archive"))) for d in relays.values())
    remote_rows = sorted(tuple(r.asDict(recursive=True).items()) for r in df.drop("file").collect())
    local = spark.read.format("logspool").load([os.path.join(d, "archive") for d in relays.values()])
    assert remote_rows == sorted(tuple(r.asDict(recursive=True).items()) for r in local.drop("file").collect())
    assert {r.relay for r in df.select("relay").distinct().collect()} == set(relays)


def test_the_report_on_s3_names_a_missing_and_an_unreadable_object_and_counts_the_rest(
        spark: Any, relays: dict[str, str], bucket: str, tmp_path: Any) -> None:
    """Three relays and a fourth whose archive lost one segment and had one moved to cold storage, while
    an upload is in progress: every figure is what plain Python computes from the segments that can be
    read, and the two that cannot are named (stderr and report.txt), never left out in silence."""
    for relay, d in relays.items():
        assert upload(config_file(tmp_path, d), f"s3://{bucket}", "--relay", relay).exit_code == 0
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(relays["mx2"], "archive"), broken / "archive")
    assert upload(config_file(tmp_path, str(broken)), f"s3://{bucket}", "--relay", "broken").exit_code == 0
    names = sorted(os.listdir(broken / "archive"))
    s3 = s3_server.client()
    s3.delete_object(Bucket=bucket, Key=f"broken/{names[2]}")
    cold = f"broken/{names[4]}"
    s3.copy_object(Bucket=bucket, Key=cold, CopySource={"Bucket": bucket, "Key": cold}, StorageClass="GLACIER")
    pending = s3.create_multipart_upload(Bucket=bucket, Key=f"mx3/{'f' * 16}.seg")
    s3.upload_part(Bucket=bucket, Key=f"mx3/{'f' * 16}.seg", UploadId=pending["UploadId"], PartNumber=1, Body=b"x")
    os.remove(broken / "archive" / names[2])
    os.remove(broken / "archive" / names[4])

    out = str(tmp_path / "report")
    result = CliRunner().invoke(main, ["report", "--input", f"s3://{bucket}/*", "--out", out], prog_name="mta")
    assert result.exit_code == 0, result.output
    gap, cold_seg = (int(names[i][:16], 16) for i in (2, 4))
    warnings = [line for line in result.stderr.splitlines() if line.startswith("mta report: warning: ")]
    assert len(warnings) == 2, result.stderr
    cold_prefix = f"mta report: warning: s3://{bucket}/broken/{names[4]} at offset 0: "
    assert warnings[0] == f"mta report: warning: s3://{bucket}/broken/{names[2]} at offset 0: missing segment: " \
                          f"segment {gap} is missing between {gap - 1} and {gap + 1}"
    assert warnings[1].startswith(f"{cold_prefix}unreadable: segment {cold_seg} cannot be read: ")
    assert "storage class" in warnings[1]

    readable = {**relays, "broken": str(broken)}
    want = ref.figures(ref.plain_records({r: archive_only(d, tmp_path / "only" / r) for r, d in readable.items()}))
    want = attrs.evolve(want, errors=((f"s3://{bucket}/broken/{names[2]}", 0, warnings[0].split(": ", 3)[3]),
                                      (f"s3://{bucket}/broken/{names[4]}", 0, warnings[1][len(cold_prefix):])))
    with open(os.path.join(out, "report.txt"), encoding="utf-8") as f:
        text = f.read()
    assert text == render_text(want) and result.stdout == text


def archive_only(spool_dir: str, where: Any) -> str:
    """A directory whose ``archive`` is the spool's (and which has no ``log``): what the relay uploads."""
    os.makedirs(where, exist_ok=True)
    if not os.path.exists(where / "archive"):
        os.symlink(os.path.join(spool_dir, "archive"), where / "archive")
    return str(where)



@pytest.mark.parametrize(("url", "line"), [
    ("s3://no-such-bucket-here/fleet", "mta report: --input s3://no-such-bucket-here/fleet: no such file or directory"),
    ("nosuch://x/y", "mta report: --input nosuch://x/y: unknown URL scheme nosuch://"),
])
def test_report_input_urls_that_cannot_be_read_are_one_line_before_spark(s3_endpoint: str, tmp_path: Any, url: str,
                                                                          line: str) -> None:
    result = CliRunner().invoke(main, ["report", "--input", url, "--out", str(tmp_path / "o")], prog_name="mta")
    assert (result.exit_code, result.output) == (2, line + "\n")
    assert not os.path.exists(tmp_path / "o")


def test_a_sharded_relay_uploads_each_shard_apart_and_the_report_names_them(
        relays: dict[str, str], bucket: str, tmp_path: Any) -> None:
    """Shard K archives into ``archive_dir/shards/K`` with segment ids of its own spool: it goes to
    ``URL/RELAY/shards/K/`` and the report calls it ``RELAY-K``, as its queue ids end in ``-K``."""
    d = tmp_path / "mx7"
    shutil.copytree(os.path.join(relays["mx1"], "archive"), d / "archive")
    shutil.copytree(os.path.join(relays["mx2"], "archive"), d / "archive" / "shards" / "1")
    os.makedirs(d / "shards" / "1")  # the shard's spool directory: how the relay knows it has two
    result = upload(config_file(tmp_path, str(d)), f"s3://{bucket}", "--relay", "mx7")
    assert result.exit_code == 0, result.output
    want = {**{f"mx7/{k.split('/')[1]}": v for k, v in local_archive(relays["mx1"], "mx1").items()},
            **{f"mx7/shards/1/{k.split('/')[1]}": v for k, v in local_archive(relays["mx2"], "mx2").items()}}
    assert objects(bucket) == want
    tasks = plan([f"s3://{bucket}/mx7"])
    assert len(tasks) == len(want)
    names = {relay_name_for(t.path) for t in tasks}
    assert names == {"mx7", "mx7-1"}
    local = {relay_name_for(t.path) for t in plan([str(d)])}
    assert local == {"mx7", "mx7-1"}


def test_the_driver_only_lists(relays: dict[str, str], bucket: str) -> None:
    """Planning a prefix whose every object is in cold storage (unreadable) succeeds: the driver reads no
    segment, it only lists; each object is opened by its own task. A file:// URL plans as its path."""
    d = os.path.join(relays["mx3"], "archive")
    upload_directory(d, f"s3://{bucket}/mx3")
    s3 = s3_server.client()
    for key in objects(bucket):
        s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")
    tasks = plan([f"s3://{bucket}/mx3"])
    assert [os.path.basename(t.path) for t in tasks] == [os.path.basename(p) for _s, p in archived(d)]
    assert all(t.missing is None for t in tasks) and tasks[-1].last and not tasks[0].last
    assert plan([f"file://{d}"]) == plan([d])
