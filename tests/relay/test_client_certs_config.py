"""``[client_certs]`` mistakes stop the start with one line naming the key (``check_tls``, run by serve and check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme
from relay_support import relay_config, tls_files

from mta.process.startup import check_tls
from spool import ConfigError


def test_a_ca_file_without_tls_on_the_listeners_is_refused(tmp_path: Path, ca: trustme.CA) -> None:
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    config = relay_config(str(tmp_path), {"*": "discard"}, extra=f'[client_certs]\nca_file = "{tmp_path}/ca.pem"\n')
    with pytest.raises(ConfigError, match=r"client_certs\.ca_file needs TLS on the listeners"):
        check_tls(config)


def test_a_ca_file_that_holds_no_certificate_is_refused(tmp_path: Path, ca: trustme.CA) -> None:
    cert, key = tls_files(tmp_path, ca)
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    tls = f'tls_cert = "{cert}"\ntls_key = "{key}"\n'
    config = relay_config(str(tmp_path), {"*": "discard"},
                          extra=tls + f'[client_certs]\nca_file = "{tmp_path}/ca.pem"\n')
    with pytest.raises(ConfigError, match=r"holds no PEM CA certificate") as caught:
        check_tls(config)
    assert "client_certs.ca_file" in str(caught.value)
