"""SMTP AUTH's state outside the protocol: the users file (``users``) and the failed-attempt limit (``limiter``).

The SASL exchange itself is sans-IO, in ``mta.smtp.sasl``; the session that
asks these modules is ``mta.inbound.submission``; ``mta user`` is ``cli``.
"""
