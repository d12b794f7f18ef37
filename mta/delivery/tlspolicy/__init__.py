"""Published TLS policies of the receiving side: MTA-STS (RFC 8461), DANE (RFC 7672), TLS-RPT (RFC 8460).

Theory of operation
-------------------
Opportunistic STARTTLS is defeated by anyone on the path who strips the
``STARTTLS`` capability or presents their own certificate. A receiving
domain can say that it always offers TLS, with which certificate:

- ``mtasts``: the domain's policy (``_mta-sts.DOMAIN`` TXT names its id; the
  policy itself comes over HTTPS from ``mta-sts.DOMAIN``, ``fetch``), kept on
  disk for its ``max_age`` so a restart keeps it; ``enforce`` names the MX
  hosts that may receive, each with a certificate valid for its name;
- ``dane``: TLSA records of the MX host (``_25._tcp.MX``) that the resolver
  validated (the AD bit), matched against the certificate it presents;
- ``tlsrpt``: every new session under a policy counted, success or failure,
  per policy domain, and written out as RFC 8460's daily JSON report;
- ``plan``: what a route's ``tls`` (``mx?tls=dane,mta-sts``) makes of one
  destination's hops: which may be tried and what each must present
  (``HopTls``). DANE, where it applies, takes precedence over MTA-STS
  (RFC 8461 §2).

The SMTP transport asks ``plan`` before it connects, applies the ``HopTls``
of each hop in its TLS handshake, and reports each session to ``tlsrpt``.
"""
