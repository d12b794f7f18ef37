"""Shaping: how fast, how wide and whether mail goes to each provider, adapted to what its servers answer.

Layers, each a module with one job: ``table`` (the providers, domains and
rules as the shipped ``defaults.toml`` and the operator's file give them),
``resolve`` (which provider and limits apply to a domain, and why),
``adapt`` (the adaptive state: replies in, overrides out; no I/O),
``bucket`` (a token bucket for message rates), ``gate`` (what the
scheduler asks before it starts a connection), ``rebuild`` (the adaptive
state read back from the log at start, and by ``mta shape explain``) and
``cli`` (``mta shape``).
"""
