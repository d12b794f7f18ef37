"""A small authoritative DNS server for tests: dnspython messages on a trio UDP socket.

The test chooses the records (MX, A, AAAA, TXT) and how a name misbehaves: a name
the server knows nothing about gets NXDOMAIN; a known name asked for a type
it lacks gets an empty NOERROR answer (what makes the relay fall back from MX
to the implicit MX); ``servfail`` answers SERVFAIL and ``drop`` never
answers, so the resolver times out. Names are compared without the trailing
dot and case-insensitively. It listens on 127.0.0.1 on a port the OS picks.

    dns = DnsServer()
    port = await nursery.start(dns.serve)
    dns.mx("dest.test", 10, "mx1.dest.test")
    dns.a("mx1.dest.test", "127.0.0.1")
"""

from __future__ import annotations

import socket

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.reversename
import dns.rrset
import trio


def _key(name: str) -> str:
    return name.rstrip(".").lower()


class DnsServer:
    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.known: set[str] = set()
        self.servfail_names: set[str] = set()
        self.drop_names: set[str] = set()
        self.queries: list[tuple[str, str]] = []
        self.port = 0

    # -- the zone --------------------------------------------------------------

    def _add(self, name: str, rtype: str, text: str) -> None:
        self.known.add(_key(name))
        self.records.setdefault((_key(name), rtype), []).append(text)

    def mx(self, domain: str, preference: int, host: str) -> None:
        self._add(domain, "MX", f"{preference} {_key(host)}.")

    def a(self, host: str, address: str) -> None:
        self._add(host, "A", address)

    def aaaa(self, host: str, address: str) -> None:
        self._add(host, "AAAA", address)

    def ptr(self, address: str, host: str) -> None:
        """The reverse name of ``address`` (``5.0.0.127.in-addr.arpa``) pointing at ``host``."""
        self._add(dns.reversename.from_address(address).to_text(), "PTR", f"{_key(host)}.")

    def txt(self, name: str, text: str) -> None:
        self._add(name, "TXT", '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"')

    def forget(self, name: str, rtype: str) -> None:
        """Drop ``name``'s records of ``rtype`` (the name stays known)."""
        self.records.pop((_key(name), rtype), None)

    def txt_record(self, name: str, rdata: str) -> None:
        """A TXT record in zone-file form, one or more quoted strings (``"v=DKIM1; ..." "..."``): a DKIM key's
        record as ``mta dkim keygen`` prints it, longer than one string holds."""
        self._add(name, "TXT", rdata)

    def exists(self, name: str) -> None:
        """A name with no records at all (every question gets an empty answer)."""
        self.known.add(_key(name))

    def servfail(self, name: str) -> None:
        self.servfail_names.add(_key(name))

    def drop(self, name: str) -> None:
        self.drop_names.add(_key(name))

    def heal(self, name: str) -> None:
        """Stop failing for ``name``."""
        self.servfail_names.discard(_key(name))
        self.drop_names.discard(_key(name))

    # -- serving ---------------------------------------------------------------

    def answer(self, query: dns.message.Message) -> dns.message.Message | None:
        """The response to ``query``, or None to stay silent."""
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response
        question = query.question[0]
        name = _key(question.name.to_text())
        rtype = dns.rdatatype.to_text(question.rdtype)
        self.queries.append((name, rtype))
        if name in self.drop_names:
            return None
        if name in self.servfail_names:
            response.flags &= ~dns.flags.AA
            response.set_rcode(dns.rcode.SERVFAIL)
            return response
        if name not in self.known:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response
        texts = self.records.get((name, rtype))
        if texts:
            response.answer.append(dns.rrset.from_text_list(question.name, 60, dns.rdataclass.IN, rtype, texts))
        return response

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            await sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
            task_status.started(self.port)
            while True:
                data, peer = await sock.recvfrom(65535)
                try:
                    query = dns.message.from_wire(data)
                except dns.exception.DNSException:
                    continue  # not DNS: a real server drops it too
                response = self.answer(query)
                if response is not None:
                    await sock.sendto(response.to_wire(), peer)
