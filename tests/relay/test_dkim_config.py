"""``[dkim]`` and ``[[dkim.key]]`` as the loader reads them (every mistake named by its key, all at once), and
the signer on whatever bytes a client sends.

The key files themselves are tried at start (tests/security/test_security_dkim_start.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.config import ConfigError, parse_config, problems_of
from mta.config.dkim import DkimSection
from mta.config.show import show_config
from mta.dkim.keys import signing_key
from mta.dkim.signer import Signature, Signer, Unsigned, from_domain


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, str(tmp_path / "r.toml"), str(tmp_path))
    return [f"{p.key}: {p.problem}" for p in problems_of(info.value)]


def test_keys_are_read_with_paths_against_the_file_and_show_writes_them_back(tmp_path: Path) -> None:
    text = ('[dkim]\noversign = ["From", "Subject"]\n'
            '[[dkim.key]]\ndomain = "Example.COM."\nselector = "s1"\nkey_file = "k/a.key"\n'
            '[[dkim.key]]\ndomain = "example.com"\nselector = "s2.rot"\nkey_file = "/k/b.key"\nactive = false\n')
    config = parse_config(text, str(tmp_path / "r.toml"), str(tmp_path))
    assert [(k.domain, k.selector, k.key_file, k.active) for k in config.dkim_keys] == [
        ("example.com", "s1", str(tmp_path / "k/a.key"), True), ("example.com", "s2.rot", "/k/b.key", False)]
    assert config.dkim.oversign == ("From", "Subject")
    again = parse_config(show_config(config), str(tmp_path / "r.toml"), str(tmp_path))
    assert again.dkim_keys == config.dkim_keys and again.dkim == config.dkim


def test_every_mistake_is_named_by_its_key(tmp_path: Path) -> None:
    text = ('[dkim]\nheaders = ["Subject", "Received"]\nbogus = 1\n'
            '[[dkim.key]]\ndomain = ".example.com"\nselector = "a b"\nextra = 1\n'
            '[[dkim.key]]\ndomain = "x.test"\nselector = "s"\nkey_file = "a"\n'
            '[[dkim.key]]\ndomain = "x.test"\nselector = "S"\nkey_file = "b"\n'
            '[[dkim.key]]\ndomain = "x.test"\nselector = "t"\nkey_file = "c"\n')
    found = problems(tmp_path, text)
    assert found == [
        "dkim.headers[1]: Received must not be signed (RFC 6376 §5.4: it changes in transit or is removed)",
        "dkim.bogus: unknown key",
        "dkim.key[0].domain: '.example.com' is not one domain (a key signs for exactly the domain it names)",
        "dkim.key[0].selector: 'a b' is not a selector (letters, digits and hyphens, dot-separated labels)",
        "dkim.key[0].key_file: is required",
        "dkim.key[0].extra: unknown key",
        "dkim.key[2].selector: selector 'S' of x.test is already key [1]",
        "dkim.key[3].domain: x.test has more than 2 keys (two selectors: the current one and the next)",
    ], found
    assert problems(tmp_path, '[dkim]\nheaders = ["Subject"]\n') == ["dkim.headers: must include From (RFC 6376 §5.4)"]
    assert problems(tmp_path, "[dkim]\nkey = 3\n") == [
        "dkim.key: expected an array of tables ([[dkim.key]]), got an integer 3"]


@pytest.mark.parametrize(("value", "domain"), [
    (b" Alice <alice@Example.COM>", "example.com"),
    (b' "Doe, J." <j@example.com>,\r\n k@example.com', "example.com"),
    (b" a@example.com, b@example.org", None),
    (b" undisclosed-recipients:;", None),
])
def test_the_signing_domain_is_the_one_domain_of_from(value: bytes, domain: str | None) -> None:
    found = from_domain([(b"From", value)])
    assert (found if isinstance(found, str) else None) == domain
    assert not isinstance(from_domain([(b"From", value), (b"from", value)]), str)  # two From: fields: none


_ED = signing_key(ed25519.Ed25519PrivateKey.generate(), "example.com", "s1")
_FROM = st.sampled_from([b"From: a@example.com\r\n", b"From: a@example.com\r\nFrom: b@example.com\r\n", b""])
_LINE = st.one_of(st.binary(max_size=80).map(lambda b: b + b"\r\n"), st.sampled_from(
    [b"Subject: \xff\xfe\r\n", b"No colon here\r\n", b" folded\r\n", b"\r\n", b"To:\r\n", b"\n", b"\r"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_LINE, max_size=12), _FROM, st.lists(_LINE, max_size=12))
def test_whatever_a_client_sends_is_signed_or_left_unsigned_never_an_exception(
        before: list[bytes], sender: bytes, after: list[bytes]) -> None:
    """The signer gets a client's bytes: any of them give a Signature or an Unsigned, never an exception."""
    signer = Signer((_ED,), DkimSection())
    result = signer.sign(b"".join(before) + sender + b"".join(after))
    assert isinstance(result, Signature | Unsigned)
    if isinstance(result, Signature):
        assert result.header.startswith(b"DKIM-Signature: ") and result.header.endswith(b"\r\n")


@pytest.mark.parametrize(("head", "outcome"), [
    (b"FROM: a@Example.com\r\nSubject: x\r\n", "example.com/s1"),
    (b"From: a@example.com\r\nfrom: b@example.com\r\n", "several_from"),
    (b"Subject: x\r\n", "no_from"),
    (b"From: a@example.org\r\n", "no_key"),
    (b"From: a@example.com, b@example.org\r\n", "mixed_from"),
])
def test_the_signer_signs_for_the_one_from_domain_whatever_the_names_case(head: bytes, outcome: str) -> None:
    result = Signer((_ED,), DkimSection()).sign(head + b"\r\nbody\r\n")
    assert (result.signed_by[0] if isinstance(result, Signature) else result.reason) == outcome
    if isinstance(result, Signature):  # h= counts the fields whatever the case of their names
        assert b"h=from:subject:from;" in result.header.replace(b"\r\n\t", b"")


def test_a_message_opening_with_a_continuation_line_is_left_unsigned() -> None:
    """A continuation line with no field before it (dkimpy's parser raised IndexError on it)."""
    result = Signer((_ED,), DkimSection()).sign(b" folded\r\nFrom: a@example.com\r\n\r\nbody\r\n")
    assert isinstance(result, Unsigned) and result.reason == "error" and "continuation line" in result.detail
