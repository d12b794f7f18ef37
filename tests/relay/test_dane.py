"""DANE (RFC 7672) end to end: unbound validates a zone signed with ldns-signzone; the relay trusts its AD bit.

The next hops are SMTP servers on 127.0.0.1, .3 and .4 (same port, ``[delivery]
mx_port``), each with its own certificate: .1 a leaf the ``ee`` domain pins
with DANE-EE (3 1 1), .3 a leaf under an intermediate CA that the ``ta`` domain
names with DANE-TA (2 1 1), .4 a certificate no record names. The relay is
given no CA at all: what DANE accepts it accepts on the TLSA records alone.
``plain.test`` is an unsigned zone with a TLSA record that matches nothing: an
insecure answer is no DANE, so the route's base mode (opportunistic) applies.
"""

from __future__ import annotations

import hashlib
import smtplib
from pathlib import Path

import trio
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from relay_support import DeliveryWatch, NextHop, relay_config, server_context, start_relay
from unbound_support import have_unbound, unbound

from mta.delivery.tlspolicy.dane import Tlsa, check
from spool.format.record import Status

assert have_unbound(), "unbound, ldns-keygen and ldns-signzone are needed (make sysdeps installs them)"


def spki_sha256(pem: bytes) -> str:
    key = x509.load_pem_x509_certificate(pem).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("alice@localhost", [rcpt], f"Subject: to {rcpt}\r\n\r\nbody\r\n")


def test_matching_rules_for_every_usage_selector_and_matching_type() -> None:
    ca = trustme.CA()
    inter = ca.create_child_ca()
    leaf = inter.issue_cert("mx.example.test")
    chain = [x509.load_pem_x509_certificate(p.bytes()) for p in leaf.cert_chain_pems]
    ders = [c.public_bytes(serialization.Encoding.DER) for c in chain]
    spki = chain[0].public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo)
    for record in (Tlsa(3, 0, 0, ders[0]), Tlsa(3, 0, 1, hashlib.sha256(ders[0]).digest()),
                   Tlsa(3, 1, 2, hashlib.sha512(spki).digest()), Tlsa(3, 1, 0, spki),
                   Tlsa(2, 0, 1, hashlib.sha256(ders[1]).digest())):
        assert check(ders, [record], ["mx.example.test"]) is None, record
    # DANE-TA: the name must match (DANE-EE never checks it)
    assert "does not validate" in (check(ders, [Tlsa(2, 0, 1, hashlib.sha256(ders[1]).digest())],
                                         ["other.example.test"]) or "")
    assert check(ders, [Tlsa(3, 1, 1, b"\0" * 32)], ["mx.example.test"]) is not None
    assert not Tlsa(1, 1, 1, b"").usable and not Tlsa(3, 2, 1, b"").usable and Tlsa(2, 1, 1, b"").usable


async def test_dane_delivers_to_matching_certificates_refuses_a_mismatch_and_an_unsigned_zone_falls_back(
        tmp_path: Path) -> None:
    ca = trustme.CA()
    inter = ca.create_child_ca()
    ee_cert = ca.issue_cert("mx-ee.dane.test")
    ta_cert = inter.issue_cert("mx-ta.dane.test")
    other = trustme.CA().issue_cert("mx-bad.dane.test", "mx.plain.test")
    async with trio.open_nursery() as nursery:
        hops = {"127.0.0.1": NextHop(ssl_context=server_context(ee_cert)),
                "127.0.0.3": NextHop(ssl_context=server_context(ta_cert)),
                "127.0.0.4": NextHop(ssl_context=server_context(other))}
        port = 0
        for address, hop in hops.items():
            port = await hop.start(nursery, address, port)
        ee_pin = spki_sha256(ee_cert.cert_chain_pems[0].bytes())
        ta_pin = spki_sha256(inter.cert_pem.bytes())
        signed = {"dane.test": [
            "ee IN MX 10 mx-ee", "mx-ee IN A 127.0.0.1", f"_{port}._tcp.mx-ee IN TLSA 3 1 1 {ee_pin}",
            "ta IN MX 10 mx-ta", "mx-ta IN A 127.0.0.3", f"_{port}._tcp.mx-ta IN TLSA 2 1 1 {ta_pin}",
            "bad IN MX 10 mx-bad", "mx-bad IN A 127.0.0.4", f"_{port}._tcp.mx-bad IN TLSA 3 1 1 {ee_pin}",
        ]}
        unsigned = {"plain.test": ["@ IN MX 10 mx", "mx IN A 127.0.0.4", f"_{port}._tcp.mx IN TLSA 3 1 1 {ee_pin}"]}
        async with unbound(tmp_path / "unbound", signed, unsigned) as resolver_port:
            extra = (f'[delivery]\nresolver = "127.0.0.1:{resolver_port}"\nmx_port = {port}\n'
                     'connect_timeout = "10s"\n')
            cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": "mx?tls=dane"}, extra=extra)
            relay = await start_relay(nursery, cfg)
            watch = DeliveryWatch(relay)
            for rcpt in ("a@ee.dane.test", "b@ta.dane.test", "c@bad.dane.test", "d@plain.test"):
                await trio.to_thread.run_sync(_send, relay.ports[0], rcpt)

            (ee,) = await watch.wait_for(Status.DELIVERED, 1, recipient="a@ee.dane.test")
            assert ee.next_hop.startswith("mx-ee.dane.test[127.0.0.1]") and ee.next_hop.endswith("tls=dane")
            (ta,) = await watch.wait_for(Status.DELIVERED, 1, recipient="b@ta.dane.test")
            assert ta.next_hop.startswith("mx-ta.dane.test[127.0.0.3]") and ta.next_hop.endswith("tls=dane")
            bad = (await watch.wait_for(Status.DEFERRED, 1, recipient="c@bad.dane.test"))[0]
            assert "DANE: no certificate the server sent matches its TLSA records" in bad.reply
            assert bad.enhanced == "4.7.5"  # a security failure (RFC 3463 §3.8), not "no answer from host"
            (plain,) = await watch.wait_for(Status.DELIVERED, 1, recipient="d@plain.test")
            assert plain.next_hop.startswith("mx.plain.test[127.0.0.4]") and plain.next_hop.endswith("tls=encrypted")
            assert [m.recipients for m in hops["127.0.0.4"].messages] == [["d@plain.test"]]
            assert all(m.tls for hop in hops.values() for m in hop.messages)
            nursery.cancel_scope.cancel()
