"""The delivery report job: segments → Parquet tables → pflogsumm-style figures.

Theory of operation. The segments are decoded **once** into ``records/``
(one row per log record, damaged spots included as error rows), by Spark
tasks that write its Parquet files themselves with pyarrow, from the same
Arrow batches as the ``logspool`` data source's (``mta.report.decode``; it
says why not through the data source). Three tables are built from it, read
back by Spark's own Parquet reader, and written as Parquet:

- ``messages``: one row per message (relay, message id, sender, recipients,
  size, arrival, number of attempts, final state and time);
- ``attempts``: one row per delivery attempt per recipient (time, next hop,
  outcome, SMTP code, enhanced status, reply text, duration, delay since
  arrival);
- ``queue``: the messages still live at the end of the input (or at
  ``until``): the newest envelope of the message has no FINISH.

Every figure of the report is then computed by Spark from those Parquet
files (:func:`compute_figures`) into a ``Figures`` value (``mta.report.figures``),
which the text and HTML renderers only format. The tests compute the same
``Figures`` with plain Python over the same records and compare them field by
field. The Spark session itself is made in ``mta.report.session``.

Joins go by ``(relay, position)``: positions are unique within one spool,
not across a fleet. A START whose envelope is not in the input (it lies in a
segment that was not given) drops out of ``attempts``.

``since``/``until`` (milliseconds): records appended at or after ``until`` are
ignored, as if the log ended there, so ``queue`` is the queue at ``until``;
``messages`` keeps those that arrived at or after ``since`` and ``attempts``
those made at or after it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from mta.bounce_class import default_rules, glob_regex
from mta.report.errors import ReportError
from mta.report.figures import (
    CLASSED_NAMES,
    LATENCY_EDGES_S,
    LATENCY_LABELS,
    PERCENTILES,
    QSHAPE_EDGES_MIN,
    QSHAPE_LABELS,
    STATUS_NAMES,
    TOP_N,
    DomainRow,
    Figures,
    QueueShapeRow,
)
from mta.report.html_page import render_html
from mta.report.text import render_text
from spool.export.rows import expand_paths

Progress = Callable[[str], None]


# -- building the tables -----------------------------------------------------


def _domain(col: Any) -> Any:
    from pyspark.sql import functions as F

    return F.lower(F.substring_index(col, "@", -1))


def _status_name(col: Any) -> Any:
    from pyspark.sql import functions as F

    expr = F.lit(None).cast("string")
    for i, name in reversed(list(enumerate(STATUS_NAMES))):
        expr = F.when(col == i, F.lit(name)).otherwise(expr)
    return expr


def read_records(spark: Any, inputs: Sequence[str], relay: str | None = None) -> Any:
    """The records of the segments as the job reads them: the ``logspool`` data source told the job's
    parallelism, so that it packs consecutive segments into a few partitions a core
    (``mta.report.spark_source.group_tasks``) instead of paying Spark's cost of a task per segment."""
    reader = spark.read.format("logspool").option("cores", str(spark.sparkContext.defaultParallelism))
    if relay:
        reader = reader.option("relay", relay)
    return reader.load(list(inputs))


def decode_records(spark: Any, inputs: Sequence[str], out: str, relay: str | None = None) -> str:
    """Decode the segments once into ``out/records`` (Parquet); returns its path. The Python tasks write
    the files themselves (``mta.report.decode``), not through the data source and the JVM."""
    from mta.report import decode

    return decode.decode_records(spark, inputs, out, relay)


def build_tables(spark: Any, records_path: str, since_ms: int | None = None,
                 until_ms: int | None = None) -> dict[str, Any]:
    """The ``messages``, ``attempts`` and ``queue`` DataFrames from ``records/``."""
    from pyspark.sql import functions as F

    r = spark.read.parquet(records_path).where(F.col("rtype") > 0)
    if until_ms is not None:
        r = r.where(F.col("time") * 1000 < until_ms)
    env = r.where(F.col("rtype") == 1).select(
        "relay", F.col("pos").alias("env_pos"), "message_id", "sender", "recipients", "body_size",
        "arrival_ms", "attempts", "held")
    starts = r.where(F.col("rtype") == 2).select(
        "relay", F.col("pos").alias("start_pos"), F.col("ref").alias("env_pos"),
        F.col("time_ms").alias("start_ms"), "kind")
    deliveries = r.where(F.col("rtype") == 3).select(
        "relay", F.col("ref").alias("start_pos"), "time_ms", "duration_ms", F.explode("outcomes").alias("o"))
    finishes = r.where(F.col("rtype") == 4).select("relay", F.col("ref").alias("start_pos"))
    started = starts.join(env.select("relay", "env_pos", "message_id", "arrival_ms", "attempts"),
                          ["relay", "env_pos"])

    attempts = deliveries.join(started, ["relay", "start_pos"]).select(
        "relay", "message_id", (F.col("attempts") + 1).alias("attempt"), "start_ms", "time_ms",
        F.col("o.recipient").alias("recipient"), _domain(F.col("o.recipient")).alias("domain"),
        F.col("o.next_hop").alias("next_hop"), _status_name(F.col("o.status")).alias("status"),
        F.col("o.code").alias("code"), F.col("o.enhanced").alias("enhanced"), F.col("o.reply").alias("reply"),
        F.coalesce("duration_ms", F.lit(0)).alias("duration_ms"),
        (F.col("time_ms") - F.col("arrival_ms")).alias("delay_ms"))
    attempts = attempts.withColumn("class", _bounce_class())

    end_ms = until_ms
    if end_ms is None:
        end_ms = r.select(F.max(F.greatest(F.col("time") * 1000, F.coalesce("time_ms", F.lit(0))))).first()[0] or 0

    finished = started.join(finishes, ["relay", "start_pos"]).select("relay", "env_pos").distinct()
    newest = env.groupBy("relay", "message_id").agg(F.max("env_pos").alias("env_pos"))
    live = newest.join(finished, ["relay", "env_pos"], "left_anti").join(env, ["relay", "message_id", "env_pos"])
    queue = live.select(
        "relay", "message_id", "env_pos", "sender", "recipients", F.size("recipients").alias("rcpt_count"),
        "body_size", "arrival_ms", "attempts", "held",
        ((F.lit(end_ms) - F.col("arrival_ms")) / 1000.0).alias("age_s"))

    first = env.groupBy("relay", "message_id").agg(
        F.min_by(F.struct("sender", "recipients", "body_size", "arrival_ms"), F.col("env_pos")).alias("f"))
    tries = started.where(F.col("kind") == 0).groupBy("relay", "message_id").agg(
        F.countDistinct("start_pos").alias("attempts"))
    outcome = attempts.groupBy("relay", "message_id").agg(
        *[F.count(F.when(F.col("status") == s, 1)).alias(s) for s in STATUS_NAMES],
        F.max(F.when(F.col("status") != "deferred", F.col("time_ms"))).alias("final_ms"))
    queued = queue.select("relay", "message_id", F.when(F.col("held"), "held").otherwise("queued").alias("qstate"))
    m = first.join(tries, ["relay", "message_id"], "left").join(outcome, ["relay", "message_id"], "left") \
        .join(queued, ["relay", "message_id"], "left")
    state = (F.when(F.col("qstate").isNotNull(), F.col("qstate"))
             .when(F.coalesce("bounced", F.lit(0)) > 0, "bounced")
             .when(F.coalesce("expired", F.lit(0)) > 0, "expired")
             .when(F.coalesce("deleted", F.lit(0)) > 0, "deleted")
             .when(F.coalesce("delivered", F.lit(0)) > 0, "delivered")
             .otherwise("unknown"))
    messages = m.select(
        "relay", "message_id", F.col("f.sender").alias("sender"), F.col("f.recipients").alias("recipients"),
        F.size("f.recipients").alias("rcpt_count"), F.col("f.body_size").alias("size"),
        F.col("f.arrival_ms").alias("arrival_ms"), F.coalesce("attempts", F.lit(0)).alias("attempts"),
        state.alias("state"),
        F.when(F.col("qstate").isNull(), F.col("final_ms")).alias("final_ms"))
    if since_ms is not None:
        messages = messages.where(F.col("arrival_ms") >= since_ms)
        attempts = attempts.where(F.col("time_ms") >= since_ms)
    return {"messages": messages, "attempts": attempts, "queue": queue}


def _bounce_class() -> Any:
    """An attempt's bounce class (``mta.bounce_class``, the shipped rules) as a column: the first rule that
    matches, ``other`` if none, null for an attempt that delivered. The rules' patterns run as Java regular
    expressions here (``rlike``); the shipped ones read the same in both."""
    from pyspark.sql import functions as F

    expr = F.lit("other")
    for rule in reversed(default_rules()):
        conds = []
        if rule.code:
            conds.append(F.col("code").cast("string").rlike(glob_regex(rule.code)))
        if rule.enhanced:
            conds.append(F.col("enhanced").rlike(glob_regex(rule.enhanced)))
        if rule.text is not None:
            conds.append(F.col("reply").rlike("(?i)" + rule.text.pattern))
        cond = conds[0]
        for c in conds[1:]:
            cond = cond & c
        expr = F.when(cond, F.lit(rule.klass)).otherwise(expr)
    return F.when(F.col("status").isin(*CLASSED_NAMES), expr)


# -- figures from Parquet ----------------------------------------------------


def _bucket(col: Any, edges: Sequence[float]) -> Any:
    """Index of the first edge above ``col`` (len(edges) past the last)."""
    from pyspark.sql import functions as F

    expr = F.lit(len(edges))
    for i in reversed(range(len(edges))):
        expr = F.when(col < edges[i], F.lit(i)).otherwise(expr)
    return expr


def _hist(rows: list[Any], size: int) -> tuple[int, ...]:
    counts = [0] * size
    for b, n in rows:
        counts[b] = n
    return tuple(counts)


def compute_figures(spark: Any, out: str) -> Figures:
    """Every figure of the report, from the Parquet tables under ``out``."""
    from pyspark.sql import functions as F

    msgs = spark.read.parquet(os.path.join(out, "messages"))
    att = spark.read.parquet(os.path.join(out, "attempts"))
    queue = spark.read.parquet(os.path.join(out, "queue"))
    records = spark.read.parquet(os.path.join(out, "records"))

    mrow = msgs.agg(F.count("*"), F.sum("rcpt_count"), F.sum("size"), F.min("arrival_ms"), F.max("arrival_ms")).first()
    arow = att.agg(*[F.count(F.when(F.col("status") == s, 1)) for s in STATUS_NAMES],
                   F.countDistinct(F.when(F.col("status") == "deferred", F.struct("relay", "message_id"))),
                   F.max("time_ms")).first()
    qrow = queue.agg(F.count("*"), F.count(F.when(F.col("held"), 1))).first()
    totals = {"received": mrow[0], "recipients": mrow[1] or 0, "bytes": mrow[2] or 0,
              **{s: arow[i] for i, s in enumerate(STATUS_NAMES)},
              "deferred_messages": arow[5], "queued": qrow[0], "held": qrow[1]}
    states = {r[0]: r[1] for r in msgs.groupBy("state").count().collect()}
    last = max((v for v in (arow[6], mrow[4]) if v is not None), default=None)

    delivered = att.where(F.col("status") == "delivered").withColumn("delay_s", F.col("delay_ms") / 1000.0)
    by_domain = att.groupBy("domain").agg(
        *[F.count(F.when(F.col("status") == s, 1)).alias(s) for s in STATUS_NAMES[:4]],
        F.avg(F.when(F.col("status") == "delivered", F.col("delay_ms") / 1000.0)).alias("avg"),
        F.max(F.when(F.col("status") == "delivered", F.col("delay_ms") / 1000.0)).alias("max"),
    ).collect()
    domains = sorted((DomainRow(r["domain"], r["delivered"], r["deferred"], r["bounced"], r["expired"],
                                r["avg"], r["max"]) for r in by_domain),
                     key=lambda d: (-(d.delivered + d.deferred + d.bounced + d.expired), d.domain))
    pct = delivered.agg(F.expr(f"percentile(delay_s, array({', '.join(map(str, PERCENTILES))}))")).first()[0]
    latency = tuple(pct) if pct else (None,) * len(PERCENTILES)
    lat_hist = delivered.groupBy(_bucket(F.col("delay_s"), LATENCY_EDGES_S)).count().collect()

    retries = msgs.where(F.col("attempts") > 0).groupBy("attempts").count().orderBy("attempts").collect()

    reason = F.concat_ws(" ", F.when(F.col("code") != 0, F.col("code").cast("string")),
                         F.when(F.col("enhanced") != "", F.col("enhanced")),
                         F.when(F.col("reply") != "", F.col("reply")))

    def top(df: Any, key: Any) -> tuple[tuple[str, int], ...]:
        rows = df.groupBy(key.alias("k")).count().orderBy(F.desc("count"), "k").limit(TOP_N).collect()
        return tuple((r[0], r[1]) for r in rows)

    sender_domain = F.when(F.col("sender") == "", F.lit("<>")).otherwise(_domain(F.col("sender")))
    senders = msgs.groupBy(sender_domain.alias("k")).agg(F.count("*").alias("n"), F.sum("size").alias("b")) \
        .orderBy(F.desc("n"), "k").limit(TOP_N).collect()

    hour = F.floor(F.col("t") / 3_600_000) * 3_600_000
    received_h = msgs.select(F.col("arrival_ms").alias("t")).groupBy(hour.alias("h")).agg(F.count("*").alias("rx"))
    delivered_h = att.where(F.col("status") == "delivered").select(F.col("time_ms").alias("t")) \
        .groupBy(hour.alias("h")).agg(F.count("*").alias("dx"))
    per_hour = received_h.join(delivered_h, "h", "full").orderBy("h").collect()

    qexp = queue.select(F.explode("recipients").alias("r"), "age_s") \
        .select(_domain(F.col("r")).alias("domain"), _bucket(F.col("age_s") / 60.0, QSHAPE_EDGES_MIN).alias("b"))
    qcells: dict[str, list[int]] = {}
    for r in qexp.groupBy("domain", "b").count().collect():
        qcells.setdefault(r[0], [0] * len(QSHAPE_LABELS))[r[1]] = r[2]
    qshape = sorted((QueueShapeRow(d, sum(c), tuple(c)) for d, c in qcells.items()), key=lambda q: (-q.total, q.domain))

    errors = records.where(F.col("rtype") == 0).select(
        "file", F.col("pos").bitwiseAND(0xFFFFFFFF).alias("offset"), "error").orderBy("file", "offset").collect()

    return Figures(
        first_ms=mrow[3],
        last_ms=last,
        totals=totals,
        states=states,
        domains=tuple(domains),
        latency=latency,
        latency_hist=_hist(lat_hist, len(LATENCY_LABELS)),
        retries=tuple((r[0], r[1]) for r in retries),
        top_deferrals=top(att.where(F.col("status") == "deferred"), reason),
        top_bounces=top(att.where(F.col("status").isin("bounced", "expired")), reason),
        bounce_classes=top(att.where(F.col("class").isNotNull()), F.col("class")),
        top_sender_domains=tuple((r[0], r[1], r[2]) for r in senders),
        top_recipient_domains=top(msgs.select(F.explode("recipients").alias("r")), _domain(F.col("r"))),
        per_hour=tuple((r[0], r[1] or 0, r[2] or 0) for r in per_hour),
        queue_shape=tuple(qshape),
        errors=tuple((r[0], r[1], r[2]) for r in errors),
    )


# -- the whole job -----------------------------------------------------------


def run_report(spark: Any, inputs: Sequence[str], out: str, *, since_ms: int | None = None,
               until_ms: int | None = None, relay: str | None = None,
               progress: Progress = lambda _m: None) -> Figures:
    """Decode, write the tables, compute the figures, write report.txt and report.html.

    Raises ReportError when the inputs hold no segment file.
    """
    files = expand_paths(inputs)
    if not files:
        raise ReportError(f"no segment files (*.seg) under: {', '.join(inputs)}")
    os.makedirs(out, exist_ok=True)
    progress(f"decoding {len(files)} segment files into {os.path.join(out, 'records')}")
    records = decode_records(spark, inputs, out, relay)
    for name, df in build_tables(spark, records, since_ms, until_ms).items():
        progress(f"writing {name}/")
        df.write.mode("overwrite").parquet(os.path.join(out, name))
    progress("computing figures")
    figures = compute_figures(spark, out)
    with open(os.path.join(out, "report.txt"), "w", encoding="utf-8") as f:
        f.write(render_text(figures))
    with open(os.path.join(out, "report.html"), "w", encoding="utf-8") as f:
        f.write(render_html(figures))
    progress(f"wrote {os.path.join(out, 'report.txt')} and report.html")
    return figures
