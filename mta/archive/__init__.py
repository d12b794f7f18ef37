"""``mta archive upload``: a relay's archived segments into the fleet's archive (object storage, HDFS, a path).

Modules: ``upload`` (which segments, where, skip or send), ``cli`` (the
click command), ``errors`` (what the operator must fix, one line each).
The report (``mta.report``) reads what this writes; the relay never imports
this package.
"""
