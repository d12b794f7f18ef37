"""DKIM signing (RFC 6376, RFC 8463 for Ed25519): keys, the signer, signing at acceptance, ``mta dkim keygen``.

- ``keys``: key files in, dkimpy's forms and the DNS TXT record out; a key that cannot sign is a start error;
- ``signer``: which keys sign a message (its From: domain) and the DKIM-Signature fields (dkimpy);
- ``accept``: signing as a message is accepted, in a worker thread, the signature stored with the message;
- ``keygen``: new key pairs and the record to publish (``mta dkim keygen``).

Config is ``[dkim]`` and ``[[dkim.key]]`` (``mta.config.dkim``); docs/security.md, "DKIM signing".
"""

from __future__ import annotations

import logging

from mta.config import Config
from mta.dkim import canon
from mta.dkim.keys import load_keys
from mta.dkim.signer import Signer

__all__ = ["signer_for"]

log = logging.getLogger("mta.dkim")


def signer_for(config: Config) -> Signer | None:
    """The signer of ``config``'s keys, or None when there are none.

    Raises KeyProblem (a ConfigError): a key file the relay cannot sign with.
    """
    if not config.dkim_keys:
        return None
    if not canon.NATIVE:
        log.warning("dkim: mta.dkim._canon was not built at install (no C compiler or Python headers); "
                    "messages are canonicalised in Python, with the same signatures at several times the CPU "
                    "for a large message (docs/security.md, \"DKIM signing\")")
    return Signer(load_keys(config.dkim_keys, config.source), config.dkim)
