"""What a route's ``tls`` makes of one destination's hops: which may be tried, and what TLS each must have.

The route's base mode (``none``, ``opportunistic``, ``require``, ``verify``)
applies where no policy does. With ``mta-sts`` the recipient domain's policy
decides for the MX hosts: in ``enforce`` mode only the hosts it names are
tried, each with a certificate valid for its name (``verify``); if none is
named, nothing is tried and the batch is deferred with the reason. In
``testing`` mode every host is tried as before; what enforce would have
refused is logged (``event=mta_sts_testing``) and counted for TLS-RPT, and
a certificate that fails is tried again without the check. With ``dane`` a
hop whose TLSA records validate takes DANE instead (RFC 8461 §2: DANE wins).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import attrs
import dns.asyncresolver

from mta.config import Config, TlsPolicy, parse_tls
from mta.delivery import mx
from mta.delivery.tlspolicy import dane
from mta.delivery.tlspolicy.mtasts import Policies
from mta.delivery.tlspolicy.tlsrpt import PolicyRef, Reporter
from mta.delivery.transport import Destination
from mta.observe.logline import event

log = logging.getLogger("mta.tlspolicy")

# The policy types of RFC 8460 (``PolicyRef.kind``) as the relay's metrics name them.
POLICY_NAMES = {"sts": "mta-sts", "tlsa": "dane"}


@attrs.frozen
class HopTls:
    """What TLS one hop must have.

    ``mode``: how STARTTLS is used (``none``, ``opportunistic``, ``require``,
    ``verify``: chain and ``server_name`` checked, ``dane``: the certificate
    must match ``tlsa``). ``label``: what ``tls=`` says of a session that met
    it. ``report``: the policy the session counts for in TLS-RPT.
    ``testing``: an MTA-STS policy in testing mode: a failure is logged and
    the hop tried again as ``relaxed()``. ``refuse``: the hop must not be
    tried at all (why), ``refuse_result`` its TLS-RPT result type.
    """

    mode: str
    server_name: str
    label: str
    tlsa: tuple[dane.Tlsa, ...] = ()
    names: tuple[str, ...] = ()  # DANE-TA: the names the certificate may carry (RFC 7672 §3.2.2)
    report: PolicyRef | None = None
    testing: bool = False
    refuse: str = ""
    refuse_result: str | None = None

    @property
    def requires_tls(self) -> bool:
        return self.mode in ("require", "verify", "dane")

    def relaxed(self) -> HopTls:
        """The same hop as opportunistic TLS: what an MTA-STS testing policy falls back to."""
        return HopTls("opportunistic", self.server_name, "encrypted")


def base_tls(mode: str, server_name: str) -> HopTls:
    return HopTls(mode, server_name, "verified" if mode == "verify" else "encrypted")


@attrs.frozen
class Plan:
    """The hops to try, in order, each with its ``HopTls``; or ``refused``: none may be tried, and why."""

    hops: tuple[tuple[mx.Hop, HopTls], ...]
    refused: str = ""


class Planner:
    """Policies, looked up per destination; the TLS-RPT reporter (None without ``report_dir``).

    ``observers`` are told each outcome that TLS-RPT counts, as (policy, result): ``mta-sts`` or ``dane``,
    and ``success`` or RFC 8460's result type; the relay's metrics are one (``Metrics.tls_policy_outcome``).
    They are told whether or not reports are written.
    """

    def __init__(self, config: Config, resolver: dns.asyncresolver.Resolver) -> None:
        t = config.tls_policy
        self.resolver = resolver
        self.sts = Policies(resolver, t.mta_sts_cache, port=t.mta_sts_port, timeout=t.mta_sts_timeout,
                            ca_file=config.delivery.tls_ca_file)
        self.dane = dane.TlsaLookup(resolver)
        self.reporter: Reporter | None = None
        if t.report_dir is not None:
            self.reporter = Reporter(os.path.join(config.spool.dir, "tls-report"), t.report_dir,
                                     t.report_organization, t.report_contact)
        self.observers: list[Callable[[str, str], None]] = []

    def record(self, hop_tls: HopTls, hop: mx.Hop, result: str | None, local: str = "", detail: str = "") -> None:
        """One session under a policy, for TLS-RPT and the observers (nothing if no policy applied)."""
        if hop_tls.report is not None:
            self._count(hop_tls.report, result, hop.host, hop.address, local, detail)

    def _count(self, ref: PolicyRef, result: str | None, mx_host: str, address: str, local: str = "",
               detail: str = "") -> None:
        """One outcome under ``ref``: ``result`` None for a success, else its RFC 8460 result type."""
        for observe in self.observers:
            observe(POLICY_NAMES.get(ref.kind, ref.kind), result or "success")
        if self.reporter is not None:
            self.reporter.record(ref, result=result, mx_host=mx_host, address=address, local=local, detail=detail)

    async def plan(self, destination: Destination, hops: list[mx.Hop], qids: list[str]) -> Plan:
        mode, policies = parse_tls(destination.tls)
        planned = [(hop, base_tls(mode.value, hop.host)) for hop in hops]
        sts: list[tuple[mx.Hop, HopTls]] | str = planned
        if TlsPolicy.MTA_STS in policies and destination.kind == "mx":
            sts = await self._mta_sts(destination.target, planned, qids)
            if isinstance(sts, str):
                if TlsPolicy.DANE not in policies:
                    return Plan((), sts)
                planned = [(hop, attrs.evolve(t, refuse=sts, refuse_result="validation-failure"))
                           for hop, t in planned]  # a host DANE secures below may still take it
            else:
                planned = sts
        if TlsPolicy.DANE in policies:
            planned = [(hop, await self._dane(destination, hop, hop_tls)) for hop, hop_tls in planned]
            if isinstance(sts, str) and all(hop_tls.refuse for _, hop_tls in planned):
                return Plan((), sts)  # DANE secured none of them: MTA-STS's refusal is the answer
        return Plan(tuple(planned))

    async def _mta_sts(self, domain: str, planned: list[tuple[mx.Hop, HopTls]],
                       qids: list[str]) -> list[tuple[mx.Hop, HopTls]] | str:
        """The hops under the domain's MTA-STS policy, or why none may be tried (enforce, no MX matches)."""
        found = await self.sts.lookup(domain)
        if found.failure is not None:
            self._count(PolicyRef("sts", domain), found.failure, "", "", detail=found.detail)
        policy = found.policy
        if policy is None or policy.mode == "none":
            return planned
        ref = PolicyRef("sts", domain, tuple(policy.lines()), policy.mx)
        out: list[tuple[mx.Hop, HopTls]] = []
        for hop, base in planned:
            if policy.matches(hop.host):
                out.append((hop, HopTls("verify", hop.host, "mta-sts", report=ref,
                                        testing=policy.mode == "testing")))
                continue
            detail = f"MX host {hop.host} does not match the MTA-STS policy of {domain} (mx: {', '.join(policy.mx)})"
            self._count(ref, "validation-failure", hop.host, hop.address, detail=detail)
            if policy.mode == "testing":
                event(log, "mta_sts_testing", None, qids=qids, domain=domain, relay=hop.host, would="skip",
                      detail=detail)
                out.append((hop, base))
            else:
                event(log, "mta_sts_skip", None, qids=qids, domain=domain, relay=hop.host, detail=detail)
        if not out:
            names = ", ".join(sorted({hop.host for hop, _ in planned}))
            return (f"MTA-STS policy of {domain} (enforce): no MX host matches the policy "
                    f"(mx: {', '.join(policy.mx)}; MX hosts: {names})")
        return out

    async def _dane(self, destination: Destination, hop: mx.Hop, fallback: HopTls) -> HopTls:
        """DANE for ``hop`` if its TLSA records are secure and usable, else ``fallback`` (RFC 7672 §2.2)."""
        if destination.kind == "mx" and not hop.secure:
            return fallback  # an insecure MX RRset (or address) names hosts an attacker may have chosen
        found = await self.dane.lookup(hop.host, hop.port)
        ref = PolicyRef("tlsa", destination.target if destination.kind == "mx" else hop.host,
                        tuple(str(t) for t in found.records), (hop.host,))
        if found.failure:
            # Secure TLSA records may exist and cannot be read: delivering without them could be a downgrade.
            return HopTls("dane", hop.host, "dane", report=ref, refuse=found.failure,
                          refuse_result="dnssec-invalid")
        if not found.secure or not found.records:
            return fallback
        usable = tuple(t for t in found.records if t.usable)
        if not usable:  # RFC 7672 §2.2: TLS is still required, without authentication
            return HopTls("require", hop.host, "encrypted", report=ref)
        return HopTls("dane", hop.host, "dane", tlsa=usable, names=(hop.host, destination.target), report=ref)
