"""The TLS and AUTH macros a real milter (libmilter, ``tests/support/milter_filter.py``) gets from the relay.

A client on the submission port does STARTTLS and AUTH PLAIN; the filter
writes the macros it was given into ``X-Session-Macros:`` of the message,
and the next hop receives what libmilter itself parsed.
"""

from __future__ import annotations

import smtplib
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme
from cryptography import x509
from cryptography.x509.oid import NameOID
from milter_support import message, start_test_milter
from relay_support import NextHop, relay_config, start_relay

from mta.auth.users import add_user
from mta.inbound.session import Port

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def milter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port, daemon = start_test_milter(tmp_path_factory.mktemp("milter"))
    yield port
    daemon.stop()


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("users") / "users"
    add_user(str(path), "alice", PASSWORD)
    return path


def tls_files(directory: Path, ca: trustme.CA) -> tuple[Path, Path]:
    """The relay's certificate, for 127.0.0.1 (the name smtplib checks), and its key (mode 0600)."""
    cert = ca.issue_cert("127.0.0.1", "relay.test")
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    (directory / "key.pem").chmod(0o600)
    return directory / "cert.pem", directory / "key.pem"


def macros_of(data: bytes) -> dict[str, str]:
    line = next(x for x in data.split(b"\r\n") if x.startswith(b"X-Session-Macros: "))
    pairs = line.decode().partition(": ")[2].split(";")
    return dict(p.split("=", 1) for p in pairs)


def _submit(port: int, ca: trustme.CA, client_cert: trustme.LeafCert | None) -> tuple[int, bytes]:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if client_cert is not None:
        client_cert.configure_cert(ctx)
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.ehlo("client.test")
        s.starttls(context=ctx)
        s.ehlo("client.test")
        s.login("alice", PASSWORD)
        s.mail("alice@example.org")
        s.rcpt("bob@dest.test")
        return s.data(message("macros"))


async def test_tls_and_auth_macros_reach_the_milter(tmp_path: Path, milter: int, ca: trustme.CA,
                                                    users_file: Path) -> None:
    cert, key = tls_files(tmp_path, ca)
    extra = (f'tls_cert = "{cert}"\ntls_key = "{key}"\n'  # in [server]
             f'[submission]\nlisten = ["127.0.0.1:0"]\nusers_file = "{users_file}"\n'
             f'[filters]\nsubmission_milters = ["inet:{milter}@127.0.0.1"]\n')
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                                                        extra=extra))
        got = await trio.to_thread.run_sync(_submit, relay.ports_of(Port.SUBMISSION)[0], ca, None)
        assert got[0] == 250
        (m,) = await hop.wait_messages(1)
        macros = macros_of(m.data)
        assert macros["{tls_version}"] == "TLSv1.3"
        assert macros["{cipher}"] == "TLS_AES_256_GCM_SHA384"
        assert macros["{cipher_bits}"] == "256"
        assert macros["{auth_authen}"] == "alice"
        assert macros["{auth_type}"] == "PLAIN"
        # No AUTH= on MAIL, and no client certificate: Postfix sends neither macro then, nor do we.
        assert macros["{auth_author}"] == "None"
        assert macros["{cert_subject}"] == "None" and macros["{cert_issuer}"] == "None"
        nursery.cancel_scope.cancel()


async def test_a_verified_client_certificate_gives_cert_subject_and_issuer(tmp_path: Path, milter: int,
                                                                           ca: trustme.CA, users_file: Path) -> None:
    cert, key = tls_files(tmp_path, ca)
    ca.cert_pem.write_to_path(str(tmp_path / "clients-ca.pem"))
    extra = (f'tls_cert = "{cert}"\ntls_key = "{key}"\n'
             f'[submission]\nlisten = ["127.0.0.1:0"]\nusers_file = "{users_file}"\n'
             f'[filters]\nsubmission_milters = ["inet:{milter}@127.0.0.1"]\n'
             f'[client_certs]\nca_file = "{tmp_path / "clients-ca.pem"}"\n')
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        hop_port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"dest.test": f"smtp://127.0.0.1:{hop_port}"},
                                                        extra=extra))
        client = ca.issue_cert("client.test", common_name="laptop.client.test")
        got = await trio.to_thread.run_sync(_submit, relay.ports_of(Port.SUBMISSION)[0], ca, client)
        assert got[0] == 250
        got = await trio.to_thread.run_sync(_submit, relay.ports_of(Port.SUBMISSION)[0], ca, None)
        assert got[0] == 250  # no certificate is no refusal
        with_cert, without = await hop.wait_messages(2)
        macros = macros_of(with_cert.data)
        assert macros["{cert_subject}"] == "laptop.client.test"
        issuer = x509.load_pem_x509_certificate(ca.cert_pem.bytes()).subject
        assert not issuer.get_attributes_for_oid(NameOID.COMMON_NAME)  # the CA has no CN: it is named by its O
        assert macros["{cert_issuer}"] == issuer.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
        assert macros_of(without.data)["{cert_subject}"] == "None"
        nursery.cancel_scope.cancel()


async def test_a_client_certificate_from_another_ca_fails_the_handshake(tmp_path: Path, ca: trustme.CA,
                                                                        users_file: Path) -> None:
    cert, key = tls_files(tmp_path, ca)
    ca.cert_pem.write_to_path(str(tmp_path / "clients-ca.pem"))
    extra = (f'tls_cert = "{cert}"\ntls_key = "{key}"\n'
             f'[submission]\nlisten = ["127.0.0.1:0"]\nusers_file = "{users_file}"\n'
             f'[client_certs]\nca_file = "{tmp_path / "clients-ca.pem"}"\n')
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"dest.test": "discard"}, extra=extra))
        stranger = trustme.CA().issue_cert("client.test")
        with pytest.raises((ssl.SSLError, smtplib.SMTPServerDisconnected, ConnectionError)):
            await trio.to_thread.run_sync(_submit, relay.ports_of(Port.SUBMISSION)[0], ca, stranger)
        nursery.cancel_scope.cancel()
