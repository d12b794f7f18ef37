"""The delivery report: spool segments → Spark → Parquet tables → a text report and an HTML page.

Everything here serves ``mta report`` and only it; the relay never imports
this package, and ``pip install logspool`` without the ``spark`` extra leaves
it unusable but harmless (the command says what to install).

Modules, and the direction of their imports (each imports only those to its
right on its line, so there is no cycle):

- ``cli``: the click command; argument checks before any JVM starts → ``session``, ``errors``
- ``job``: decode once, build the tables, compute the figures, write the reports
  → ``decode``, ``figures``, ``text``, ``html_page``, ``errors`` (and ``spool.export.rows``)
- ``decode``: the segments into ``records/``, Parquet files written by the Spark tasks themselves with
  pyarrow and committed by the driver → ``spark_source``, ``errors``
  (and ``spool.export.rows``, ``spool.export.remote``)
- ``session``: the SparkSession, local mode tuned for small machines → ``shipping``, ``spark_source``, ``errors``
- ``shipping``: on a cluster, the project's packages zipped for the executors, and the check that
  their Python can run them → ``errors``
- ``spark_source``: the ``logspool`` PySpark data source over segment files → ``spool.export.rows``
- ``html_page``: the report as one self-contained HTML page → ``charts``, ``text``, ``figures``
- ``text``: the report as plain text, pflogsumm-style → ``figures``
- ``charts``: bar charts as inline SVG, drawn by matplotlib (the benchmarks use it too)
- ``figures``: the ``Figures`` value and the label tables everything above shares
- ``errors``: ``ReportError``, one line for the operator
"""
