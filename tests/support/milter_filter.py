"""A test milter on Debian's python3-milter (libmilter): every action and reply, chosen by the message.

Run under the system Python (``/usr/bin/python3 milter_filter.py inet:PORT@127.0.0.1``),
not the project's virtualenv: python3-milter is a Debian package. It prints
``ready`` once libmilter is about to listen, then serves until killed.

What it does is chosen by the sender's or a recipient's local part (at MAIL
and RCPT) and by the Subject: (at the end of the message):

- sender ``reject-mail``: REJECT at MAIL; ``tempfail-mail``: TEMPFAIL at MAIL;
- sender ``reject-data``, ``tempfail-data``, ``custom-data``: REJECT, TEMPFAIL or
  ``550 5.7.2 refused at data`` at DATA;
- recipient ``reject-rcpt``: REJECT that recipient; ``custom-rcpt``: ``550 5.1.1 no such user here``;
- Subject ``reject``, ``tempfail``, ``custom`` (``554 5.7.0 custom words``), ``discard``, ``accept``,
  ``quarantine``, ``headers`` (add, insert at 0, change, delete), ``body`` (replaced),
  ``envelope`` (sender changed, ``added@dest.test`` added, ``gone@dest.test`` removed),
  ``slow`` (no answer for 30 s), ``progress`` (3 s of progress notes, then an answer);
- every message it lets through otherwise gets ``X-Test-Milter: seen`` and ``X-Macros:`` with the
  macros it was given (``i``, ``j``, ``{client_addr}``, ``{daemon_name}``, ``{mail_addr}``);
  with Subject ``macros`` also ``X-Session-Macros:``, the TLS and AUTH macros (``name=value;...``).
"""

from __future__ import annotations

import sys
import time

import Milter


class TestFilter(Milter.Base):  # type: ignore[misc]
    def __init__(self) -> None:
        self.subject = ""
        self.sender = ""

    def connect(self, hostname: str, family: int, hostaddr: object) -> int:
        return int(Milter.CONTINUE)

    def hello(self, name: str) -> int:
        return int(Milter.CONTINUE)

    def envfrom(self, sender: str, *params: str) -> int:
        self.subject = ""
        self.sender = sender.strip("<>")
        if self.sender.startswith("reject-mail@"):
            return int(Milter.REJECT)
        if sender.strip("<>").startswith("tempfail-mail@"):
            return int(Milter.TEMPFAIL)
        return int(Milter.CONTINUE)

    def envrcpt(self, rcpt: str, *params: str) -> int:
        local = rcpt.strip("<>").partition("@")[0]
        if local == "reject-rcpt":
            return int(Milter.REJECT)
        if local == "custom-rcpt":
            self.setreply("550", "5.1.1", "no such user here")
            return int(Milter.REJECT)
        return int(Milter.CONTINUE)

    def data(self) -> int:
        local = self.sender.partition("@")[0]
        if local == "reject-data":
            return int(Milter.REJECT)
        if local == "tempfail-data":
            return int(Milter.TEMPFAIL)
        if local == "custom-data":
            self.setreply("550", "5.7.2", "refused at data")
            return int(Milter.REJECT)
        return int(Milter.CONTINUE)

    def header(self, name: str, value: str) -> int:
        if name.lower() == "subject":
            self.subject = value.strip().lower()
        return int(Milter.CONTINUE)

    def body(self, chunk: bytes) -> int:
        return int(Milter.CONTINUE)

    def eom(self) -> int:
        s = self.subject
        simple = {"reject": Milter.REJECT, "tempfail": Milter.TEMPFAIL, "discard": Milter.DISCARD,
                  "accept": Milter.ACCEPT}
        if s in simple:
            return int(simple[s])
        if s == "custom":
            self.setreply("554", "5.7.0", "custom words")
            return int(Milter.REJECT)
        if s == "slow":
            time.sleep(30)
        if s == "progress":
            for _ in range(6):
                time.sleep(0.5)
                self.progress()
        if s == "quarantine":
            self.quarantine("held by the test milter")
        if s == "headers":
            self.addheader("X-Added", "added at the end")
            self.addheader("X-Inserted", "inserted first", 0)
            self.chgheader("X-Change", 1, "changed value")
            self.chgheader("X-Remove", 1, "")
        if s == "body":
            self.replacebody(b"the body the milter wrote\r\nline two\r\n")
        if s == "envelope":
            self.chgfrom("<new-sender@example.org>")
            self.addrcpt("<added@dest.test>")
            self.delrcpt("<gone@dest.test>")
        macros = ",".join(f"{n}={self.getsymval(n)}" for n in ("i", "j", "{client_addr}", "{daemon_name}",
                                                                 "{mail_addr}"))
        if s == "macros":
            names = ("{tls_version}", "{cipher}", "{cipher_bits}", "{cert_subject}", "{cert_issuer}",
                     "{auth_authen}", "{auth_type}", "{auth_author}")
            self.addheader("X-Session-Macros", ";".join(f"{n}={self.getsymval(n)}" for n in names))
        self.addheader("X-Test-Milter", "seen")
        self.addheader("X-Macros", macros)
        return int(Milter.CONTINUE)


def main() -> None:
    Milter.factory = TestFilter
    Milter.set_flags(Milter.ADDHDRS | Milter.CHGHDRS | Milter.CHGBODY | Milter.ADDRCPT | Milter.DELRCPT
                     | Milter.CHGFROM | Milter.QUARANTINE)
    print("ready", flush=True)
    Milter.runmilter("logspool-test", sys.argv[1], 60)


if __name__ == "__main__":
    main()
