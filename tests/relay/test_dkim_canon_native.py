"""DKIM's two every-byte passes in C (``mta.dkim._canon``) give the bytes of their Python twins.

The relay signs through the C module wherever it was built; dkimpy's
references (test_dkim_reference.py) hold the relay's signatures, so they hold
the C module too. These tests hold the two forms to each other on inputs
long enough to cross the 16-byte steps of the C scan at every offset, and
check that the install built the module (``make test`` installs it with a
compiler, as ``make run`` does).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.config import parse_config
from mta.dkim import _canon, canon, signer_for
from mta.dkim.signer import Signature

_piece = st.sampled_from([b" ", b"  ", b"\t", b"\r", b"\n", b"\r\n", b" \r\n", b"\t\r\n", b"a", b"word", b"x" * 17])
_bodies = st.lists(_piece, max_size=80).map(b"".join)


def test_the_install_built_the_c_module() -> None:
    assert canon.NATIVE
    assert canon.relaxed_wsp is _canon.relaxed_wsp
    assert canon.bare_lf is _canon.bare_lf


@settings(max_examples=2000, deadline=None)
@given(body=_bodies, shift=st.integers(0, 15))
def test_relaxed_spaces_are_the_python_twins(body: bytes, shift: int) -> None:
    shifted = b"y" * shift + body  # the same runs at every offset within a 16-byte step
    assert _canon.relaxed_wsp(shifted) == canon.relaxed_wsp_python(shifted)


@settings(max_examples=2000, deadline=None)
@given(data=_bodies, shift=st.integers(0, 15))
def test_bare_lf_is_the_python_twins(data: bytes, shift: int) -> None:
    shifted = b"y" * shift + data
    assert _canon.bare_lf(shifted) is canon.bare_lf_python(shifted)


@pytest.mark.parametrize("where", range(40))
def test_a_bare_lf_or_a_changed_run_is_found_at_every_position(where: int) -> None:
    clean = b"ab\r\n" * 10
    assert not _canon.bare_lf(clean)
    assert _canon.bare_lf(clean[:where] + b"\n" + clean[where:]) is canon.bare_lf_python(
        clean[:where] + b"\n" + clean[where:])
    text = b"abcd" * 10
    for run in (b"  ", b"\t", b" \r\n", b" \t\r\n"):
        body = text[:where] + run + text[where:]
        assert _canon.relaxed_wsp(body) == canon.relaxed_wsp_python(body)


def test_nothing_to_change_gives_the_same_object_back() -> None:
    body = b"one space between words\r\n" * 100
    assert _canon.relaxed_wsp(body) is body


@pytest.mark.parametrize("value", [None, 3, "text"])
def test_what_is_not_bytes_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        _canon.relaxed_wsp(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _canon.bare_lf(value)  # type: ignore[arg-type]


def test_a_relay_without_the_c_module_signs_the_same_and_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "ed.key"
    key.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o600)
    text = f'[[dkim.key]]\ndomain = "example.com"\nselector = "ed1"\nkey_file = "{key}"\n'
    config = parse_config(text, str(tmp_path / "r.toml"), str(tmp_path))
    message = b"From: a@example.com\r\nSubject: s\r\n\r\nbody  with\t runs \r\n\r\n"
    native = signer_for(config)
    assert native is not None and not [r for r in caplog.records if "_canon" in r.getMessage()]
    monkeypatch.setattr(canon, "NATIVE", False)
    monkeypatch.setattr(canon, "relaxed_wsp", canon.relaxed_wsp_python)
    monkeypatch.setattr(canon, "bare_lf", canon.bare_lf_python)
    python = signer_for(config)
    assert python is not None
    warned = [r for r in caplog.records if "mta.dkim._canon was not built" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    assert canon.body_canonical(canon.split(message).body, True) == b"body with runs\r\n"
    signed_native, signed_python = native.sign(message), python.sign(message)
    assert isinstance(signed_native, Signature) and isinstance(signed_python, Signature)
    bh = re.compile(rb"bh=([^;]+);")
    assert bh.findall(signed_native.header) == bh.findall(signed_python.header) != []
