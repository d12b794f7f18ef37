"""The time and slot arithmetic behind the denial-of-service limits (docs/security.md, "Denial of service").

``SessionDeadlines`` and ``SessionSlots`` have no I/O, so these tests run the
default settings against whole simulated sessions (a slow link, a trickle) in
virtual time. The same limits against the real relay over TCP are in
``test_security_dos.py``.
"""

from __future__ import annotations

import math

import pytest

from mta.config import ServerConfig, parse_config
from mta.inbound.admission import CLIENT_CACHE, Refusal, SessionSlots, Slot, client_keys
from mta.inbound.deadlines import SessionDeadlines

DEFAULTS = parse_config("").server


def _data_phase(server: ServerConfig, size: int, segment: int, rate: float) -> float | None:
    """Feed a DATA phase of ``size`` bytes in ``segment``-byte reads arriving at ``rate`` bytes/s.

    Returns when the deadline would have cut it (seconds into the phase), or
    None if the whole message arrived in time.
    """
    d = SessionDeadlines.for_session(server, 0.0)
    d.data_start(0.0)
    now, sent = 0.0, 0
    while sent < size:
        chunk = min(segment, size - sent)
        arrival = now + chunk / rate
        if arrival > d.deadline:
            return d.deadline
        now, sent = arrival, sent + chunk
        d.received(now, chunk)
    return None


def test_defaults_let_10mb_through_a_64_kbit_link() -> None:
    # 64 kbit/s is 8000 bytes/s: 10 MiB takes 22 minutes, twice data_timeout, and passes.
    assert _data_phase(DEFAULTS, 10 << 20, 1448, 8000) is None
    # So do eight such sessions sharing the link (1000 bytes/s each, exactly min_data_rate).
    assert _data_phase(DEFAULTS, 10 << 20, 1448, 1000) is None


def test_defaults_cut_a_trickle_within_data_timeout() -> None:
    # One byte every 3 s: per-read timeouts would never fire; the DATA deadline does, after about data_timeout.
    cut = _data_phase(DEFAULTS, 10 << 20, 1, 1 / 3)
    assert cut is not None and DEFAULTS.data_timeout <= cut < DEFAULTS.data_timeout + 1
    # Just under the minimum rate is cut too, only later.
    assert _data_phase(DEFAULTS, 10 << 20, 1448, 900) is not None


def test_a_stall_longer_than_data_timeout_is_cut_whatever_came_before() -> None:
    d = SessionDeadlines.for_session(DEFAULTS, 0.0)
    d.data_start(0.0)
    d.received(1.0, 5 << 20)  # 5 MiB at once: the credit is capped at data_timeout from now
    assert d.deadline == 1.0 + DEFAULTS.data_timeout


def test_a_data_phase_never_outlasts_data_timeout_plus_max_size_over_min_rate() -> None:
    d = SessionDeadlines.for_session(DEFAULTS, 0.0)
    d.data_start(0.0)
    now = 0.0
    bound = DEFAULTS.data_timeout + DEFAULTS.max_message_size / DEFAULTS.min_data_rate
    for _ in range(100_000):  # a client sending at exactly the minimum rate, forever (an over-size message)
        now += 1.0
        if now > d.deadline:
            break
        d.received(now, DEFAULTS.min_data_rate)
    assert now > d.deadline and d.deadline <= bound


def test_a_command_deadline_does_not_move_with_reads() -> None:
    d = SessionDeadlines.for_session(DEFAULTS, 0.0)
    d.command(10.0)
    for t in range(11, 200):
        d.received(float(t), 1)
    assert d.deadline == 10.0 + DEFAULTS.command_timeout


def test_the_relays_own_waits_do_not_count_against_the_client() -> None:
    d = SessionDeadlines.for_session(DEFAULTS, 0.0)
    d.data_start(0.0)
    d.pause(42.0)
    assert d.deadline == DEFAULTS.data_timeout + 42.0


def test_the_session_time_limit_is_checked_against_its_start() -> None:
    d = SessionDeadlines.for_session(DEFAULTS, 100.0)
    assert not d.session_over(100.0 + DEFAULTS.session_time_limit - 1)
    assert d.session_over(100.0 + DEFAULTS.session_time_limit)
    assert math.isinf(SessionDeadlines.for_session(DEFAULTS, 0.0).deadline)  # unarmed until the first command


def _config(extra: str) -> SessionSlots:
    text = f'[server]\nmax_sessions = 6\nreserved_sessions = 2\n{extra}\n[relay]\nmynetworks = ["192.0.2.0/24"]\n'
    return SessionSlots(parse_config(text))


def test_outsiders_never_take_the_reserved_slots() -> None:
    slots = _config("max_sessions_per_client = 10\nmax_sessions_per_network = 10")
    held = [slots.admit(f"198.51.100.{i}") for i in range(4)]
    assert all(isinstance(s, Slot) for s in held)
    assert slots.admit("198.51.100.9") is Refusal.RESERVED
    assert isinstance(slots.admit("192.0.2.1"), Slot) and isinstance(slots.admit("192.0.2.1"), Slot)
    assert slots.admit("192.0.2.2") is Refusal.TOTAL


def test_per_client_and_per_network_limits_exempt_mynetworks() -> None:
    slots = _config("max_sessions_per_client = 1\nmax_sessions_per_network = 2")
    first = slots.admit("198.51.100.1")
    assert isinstance(first, Slot)
    assert slots.admit("198.51.100.1") is Refusal.CLIENT
    assert isinstance(slots.admit("::ffff:198.51.100.2"), Slot)  # a v4-mapped address is the IPv4 client
    assert slots.admit("198.51.100.3") is Refusal.NETWORK
    assert isinstance(slots.admit("203.0.113.1"), Slot)  # another /24
    assert isinstance(slots.admit("192.0.2.7"), Slot) and isinstance(slots.admit("192.0.2.7"), Slot)  # trusted
    slots.release(first)
    assert isinstance(slots.admit("198.51.100.3"), Slot)  # freed


@pytest.mark.parametrize(("address", "client", "network"), [
    ("192.0.2.77", "192.0.2.77", "192.0.2.0/24"),
    ("::ffff:192.0.2.77", "192.0.2.77", "192.0.2.0/24"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("not-an-ip", "not-an-ip", "not-an-ip"),
])
def test_clients_are_counted_by_address_and_by_24_or_64(address: str, client: str, network: str) -> None:
    assert client_keys(address) == (client, network)


def test_remembered_clients_are_counted_as_the_first_time_and_the_memory_is_bounded() -> None:
    """Keys and trust are worked out once per address; a flood of addresses does not grow it."""
    slots = _config("max_sessions_per_client = 1\nmax_sessions_per_network = 2")
    first = slots.admit("198.51.100.1")
    assert isinstance(first, Slot) and not first.trusted
    slots.release(first)
    again = slots.admit("198.51.100.1")  # from memory: the same keys, still an outsider, still limited
    assert again == first
    assert slots.admit("198.51.100.1") is Refusal.CLIENT
    trusted = slots.admit("192.0.2.7")
    assert isinstance(trusted, Slot) and trusted.trusted
    slots.release(again)
    slots.release(trusted)
    for i in range(CLIENT_CACHE + 10):
        address = f"2001:db8::{i:x}"
        slot = slots.admit(address)
        assert isinstance(slot, Slot) and slot.network == "2001:db8::/64"
        slots.release(slot)
    assert len(slots._clients) <= CLIENT_CACHE
