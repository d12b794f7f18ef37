"""``mta config show [-n]``: the effective config as TOML that the loader reads back as the same ``Config``.

The property test draws values for every setting from its own definition
(``spool.config.settings`` kinds), so a setting added later is covered without a
change here; a new kind of value fails loudly until it gets a strategy.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import attrs
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from process_support import run_mta

from mta.config import Config, ConfigError, parse_config
from mta.config.bounce_classes import RulesFile
from mta.config.dkim import HeaderName
from mta.config.egress import DomainMap, Pools, ProviderMap, Sources
from mta.config.events import ConsumerName, TopicName, WebhookUrl
from mta.config.filters import HttpUrl, Milter
from mta.config.limits import RateKind, SlotCount
from mta.config.loader import definitions
from mta.config.policy import PolicyServer
from mta.config.routes import Domain
from mta.config.show import show_config, toml_value
from mta.config.smarthost_auth import SecretsFile
from mta.config.values import Address, Hostname, Listen, Mailbox, Network, Processes, ReadableFile
from spool.config.settings import Boolean, Duration, Fraction, Integer, Kind, ListOf, OneOf, Optional, Size, Text
from spool.config.settings import Path as PathKind
from spool.config.units import parse_duration

ENV = {k: v for k, v in os.environ.items() if k != "LOGSPOOL_CONFIG"}
BASE = "/base"
CA_FILE = os.path.abspath(__file__)  # any file that exists will do for a path that must name a file


def _secrets_file() -> str:
    """A smarthost secrets file as ``SecretsFile`` wants it: private, one login."""
    fd, path = tempfile.mkstemp(prefix="smarthost-", suffix=".secrets")  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write('["relay.example:587"]\nuser = "u"\npassword = "p"\n')
    atexit.register(os.unlink, path)
    return path


SECRETS_FILE = _secrets_file()


def _rules_file() -> str:
    """A bounce-class rules file with one rule (``RulesFile`` reads and checks it)."""
    fd, path = tempfile.mkstemp(prefix="classes-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write('[[rule]]\nclass = "policy"\ntext = "greylist"\n')
    atexit.register(os.unlink, path)
    return path


RULES_FILE = _rules_file()

FULL = """
[server]
listen = ["127.0.0.1:2525", "[::1]:2526"]
hostname = "relay.example"
max_message_size = "20MB"
command_timeout = "2m"
data_timeout = 90
control_socket = "run/ctl.sock"
metrics_listen = "127.0.0.1:9125"
min_data_rate = "2k"
processes = 2

[spool]
dir = "q"
archive_dir = "/srv/archive"
segment_size = "512k"
retry_intervals = ["1s", "5m", "1.5h"]
commit_delay = "20ms"
deferred_share = 0.5

[relay]
mynetworks = ["10.0.0.0/8", "::ffff:192.0.2.0/120"]
relay_domains = ["Partner.Example.", ".partner.example"]

[delivery]
resolver = "127.0.0.1"
delay_warning = "4h"

[routes]
"localhost" = "maildir:var/maildir"
"Example.COM" = "smtp://10.0.0.5"
".example.com" = "smtp://[::1]:2526?tls=require"
"*" = "mx"

[log]
level = "DEBUG"
"""


def same(shown: str, config: Config, base_dir: str | None = BASE) -> None:
    again = parse_config(shown, "shown.toml", base_dir=base_dir)
    assert attrs.evolve(again, source=config.source) == config, shown


def test_show_reads_back_as_the_same_config_and_names_every_setting(tmp_path: Path) -> None:
    config = parse_config(FULL, "full.toml", base_dir=str(tmp_path))
    shown = show_config(config)
    same(shown, config, base_dir="/elsewhere")  # every path is written absolute
    for key in definitions():
        section, name = key.split(".")
        block = shown.split(f"\n[{section}]\n", 1)[1].split("\n[", 1)[0]
        assert re.search(rf"^{name} = ", block, re.MULTILINE), key
    assert 'retry_intervals = ["1s", "5m", "90m"]' in shown
    assert 'mynetworks = ["10.0.0.0/8", "192.0.2.0/24"]' in shown
    assert '"example.com" = "smtp://10.0.0.5:25?tls=opportunistic"' in shown or \
        'example.com = "smtp://10.0.0.5:25?tls=opportunistic"' in shown


def test_show_n_names_only_what_differs_from_the_defaults(tmp_path: Path) -> None:
    text = '[server]\nmax_message_size = "20MB"\nmax_sessions = 40\n[spool]\ncommit_delay = "100ms"\n'
    config = parse_config(text, "x.toml", base_dir=str(tmp_path))
    shown = show_config(config, only_changed=True, base_dir=str(tmp_path))
    body = [line for line in shown.splitlines() if line and not line.startswith("#")]
    # commit_delay is its default; queue_minfree and reserved_sessions follow what they derive from.
    assert body == ["[server]", 'max_message_size = "20MiB"', "max_sessions = 40"]
    same(shown, config, base_dir=str(tmp_path))
    defaults = parse_config("", "d.toml", base_dir=str(tmp_path))
    assert [line for line in show_config(defaults, only_changed=True, base_dir=str(tmp_path)).splitlines()
            if line and not line.startswith("#")] == []


def test_show_n_writes_a_routes_table_whole(tmp_path: Path) -> None:
    config = parse_config('[routes]\n"*" = "discard"\n', "x.toml", base_dir=str(tmp_path))
    shown = show_config(config, only_changed=True, base_dir=str(tmp_path))
    assert shown.endswith('\n[routes]\n"*" = "discard"\n')
    same(shown, config, base_dir=str(tmp_path))


def test_mta_config_show_n_run_elsewhere_reads_defaults_from_the_files_directory(tmp_path: Path) -> None:
    """``-n`` compares with the defaults as the file's directory makes them: a default spool.dir is no change."""
    path = tmp_path / "etc" / "relay.toml"
    path.parent.mkdir()
    path.write_text('[server]\nmax_sessions = 40\n')
    run = run_mta("config", "show", "-n", "--config", str(path), cwd=Path("/"), env=ENV)
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    assert [line for line in run.stdout.splitlines() if line and not line.startswith("#")] == \
        ["[server]", "max_sessions = 40"]


def test_mta_config_show_as_a_command(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(FULL)
    for flags in ([], ["-n"]):
        run = run_mta("config", "show", "--config", str(path), *flags, cwd=tmp_path, env=ENV)
        assert (run.returncode, run.stderr) == (0, ""), run.stderr
        assert run.stdout.startswith(f"# mta config show: the settings of {path} ")
        same(run.stdout, parse_config(FULL, str(path), base_dir=str(tmp_path)), base_dir=str(tmp_path))
    path.write_text("[server]\nmax_errors = 0\nfoo = 1\n")
    run = run_mta("config", "show", "--config", str(path), cwd=tmp_path, env=ENV)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [f"mta: {path}: server.max_errors: must be between 1 and {1 << 62}, got 0",
                                       f"mta: {path}: server.foo: unknown key"]


@given(st.text(st.characters(exclude_characters="\0", codec="utf-8"), max_size=20))
def test_toml_value_writes_any_string_back(text: str) -> None:
    import tomllib

    assert tomllib.loads(f"x = {toml_value(text)}")["x"] == text


# ----------------------------------------------------------------- values drawn from the definitions


def _seconds(kind: Duration) -> st.SearchStrategy[Any]:
    high = kind.at_most if kind.at_most is not None else 10 * 365 * 86400.0
    numbers = st.one_of(st.integers(0, int(high)), st.floats(0, high), st.sampled_from([0.1, 0.25, 1.5, 90.0]))
    units = st.builds(lambda n, u: f"{n}{u}", st.integers(0, 100), st.sampled_from(["ms", "s", "m", "h", "d", "w"]))
    values = st.one_of(numbers, units).filter(lambda x: parse_duration(x) <= high)
    return values.filter(lambda x: parse_duration(x) > 0) if kind.positive else values


def _bytes(kind: Size) -> st.SearchStrategy[Any]:
    high = kind.high if kind.high is not None else 1 << 40
    low = max(kind.low, 1 if kind.positive else 0)
    return st.one_of(st.integers(low, high),
                     st.builds(lambda n, u: f"{n}{u}", st.integers(max(-(-low // 1024), 1), min(high >> 10, 4096)),
                               st.sampled_from(["k", "KiB", "kb"])))


LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
HOST = st.builds(".".join, st.lists(LABEL, min_size=1, max_size=3))


def _network() -> st.SearchStrategy[str]:
    v4 = st.builds(lambda a, p: str(ipaddress.ip_network(f"{a}/{p}", strict=False)), st.ip_addresses(v=4),
                   st.integers(8, 32))
    v6 = st.builds(lambda a, p: str(ipaddress.ip_network(f"{a}/{p}", strict=False)), st.ip_addresses(v=6),
                   st.integers(16, 128))
    return st.one_of(v4, v6)


EGRESS_ADDRESSES = ["192.0.2.1", "192.0.2.2", "2001:db8::1"]


def _source_entry() -> st.SearchStrategy[dict[str, Any]]:
    """One ``[egress.sources]`` entry: nothing, an EHLO name, or a warm-up schedule with its start."""
    steps = st.lists(st.tuples(st.integers(1, 3650), st.integers(0, 10**6)), max_size=4, unique_by=lambda t: t[0])
    warmup = st.builds(lambda d, xs: {"warmup_start": d.isoformat(), "warmup": [list(x) for x in sorted(xs)]},
                       st.dates(), steps)
    return st.one_of(st.just({}), st.builds(lambda h: {"ehlo": h}, HOST), warmup)


def raw_values(kind: Kind[Any]) -> st.SearchStrategy[Any]:
    """TOML values a setting of ``kind`` accepts."""
    match kind:
        case Optional(inner):
            return st.one_of(st.just(""), raw_values(inner))
        case ListOf(HeaderName(), rule=rule) if rule is not None:  # dkim.headers: From among them
            return st.lists(raw_values(HeaderName()), max_size=4).map(lambda xs: ["From", *xs])
        case ListOf(OneOf(choices), rule=rule) if rule is not None:  # policy.stages: each once
            return st.lists(st.sampled_from(choices), unique=True)
        case ListOf(item, least):
            items = st.lists(raw_values(item), min_size=least, max_size=4)
            if isinstance(item, Duration):  # retry intervals must not decrease: sort them by what they mean
                return items.map(lambda xs: sorted(xs, key=parse_duration))
            return items
        case SlotCount(low, high):
            return st.integers(low // 8, min(high, low + 10**6) // 8).map(lambda n: n * 8)
        case Integer(low, high):
            return st.integers(low, min(high, low + 10**6))
        case RateKind():
            return st.builds(lambda n, w: f"{n}/{w}", st.integers(1, 10**6),
                             st.sampled_from(["1s", "90s", "1m", "15m", "1h", "1d", "7d"]))
        case PolicyServer():
            return st.one_of(st.integers(1, 65535).map(lambda p: f"inet:127.0.0.1:{p}"),
                             st.builds(lambda h, p: f"inet:{h}:{p}", HOST, st.integers(1, 65535)),
                             st.just("unix:/run/policy.sock"), st.just("unix:policy.sock"))
        case Boolean():
            return st.booleans()
        case Fraction():
            return st.floats(0, 1)
        case Duration():
            return _seconds(kind)
        case Size():
            return _bytes(kind)
        case OneOf(choices):
            return st.sampled_from(choices).flatmap(lambda c: st.sampled_from([c, c.upper(), c.title()]))
        case PathKind():
            return st.text(st.characters(exclude_characters="\0", codec="utf-8"), min_size=1, max_size=12)
        case RulesFile():
            return st.just(RULES_FILE)
        case ReadableFile():
            return st.just(CA_FILE)
        case SecretsFile():
            return st.just(SECRETS_FILE)
        case Listen(default_port):
            port = st.integers(0 if default_port is None else 1, 65535)
            host = st.one_of(st.sampled_from(["127.0.0.1", "localhost", "[::1]", "0.0.0.0"]), HOST)
            with_port = st.builds(lambda h, p: f"{h}:{p}", host, port)
            return with_port if default_port is None else st.one_of(with_port, host)
        case Hostname():
            return HOST
        case Mailbox() | Address():
            return st.builds(lambda local, host: f"{local}@{host}.example", LABEL, HOST)
        case Network():
            return _network()
        case Domain():
            return st.builds(lambda dot, host: dot + host, st.sampled_from(["", "."]), HOST)
        case Processes():
            return st.one_of(st.integers(1, 8), st.just("auto"))
        case HeaderName():
            return st.sampled_from(["From", "subject", "X-Mailer", "List-Unsubscribe", "DATE"])
        case Milter():
            port = st.integers(1, 65535)
            return st.one_of(st.builds(lambda p, h: f"inet:{p}@{h}", port, HOST),
                             st.builds(lambda h, p: f"inet:{h}:{p}", HOST, port),
                             st.builds(lambda n: f"unix:/run/{n}.sock", LABEL))
        case HttpUrl():
            return st.builds(lambda h, p: f"http://{h}:{p}", HOST, st.integers(1, 65535))
        case WebhookUrl():
            return st.builds(lambda scheme, h, port: f"{scheme}://{h}:{port}/hook", st.sampled_from(["http", "https"]),
                             HOST, st.integers(1, 65535))
        case TopicName():
            return st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,30}", fullmatch=True)
        case ConsumerName():
            return st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True).filter(
                lambda n: not n.endswith(".tmp"))
        case Sources():
            return st.dictionaries(st.sampled_from(EGRESS_ADDRESSES), _source_entry(), max_size=3)
        case Pools():
            members = st.dictionaries(st.sampled_from(EGRESS_ADDRESSES), st.integers(1, 1000), min_size=1)
            return st.dictionaries(LABEL, members, max_size=3)
        case DomainMap():
            return st.dictionaries(st.one_of(st.just("*"), HOST, HOST.map(lambda h: "." + h)),
                                   st.sampled_from(EGRESS_ADDRESSES), max_size=3)
        case ProviderMap():
            return st.dictionaries(LABEL, st.sampled_from(EGRESS_ADDRESSES), max_size=3)
        case Text(nonempty):
            return st.text(st.characters(exclude_characters="\0", codec="utf-8"), min_size=1 if nonempty else 0,
                           max_size=20)
    raise AssertionError(f"no strategy for {kind!r}: add one")


ROUTES = st.dictionaries(
    st.one_of(st.just("*"), HOST, HOST.map(lambda h: "." + h)),
    st.sampled_from(["mx", "discard", "maildir:md", "smtp://10.0.0.5", "smtp://[::1]:26?tls=verify",
                     "smtp://relay.example:587?tls=none", "mx?tls=mta-sts", "mx?tls=mta-sts,verify"]),
    max_size=4)


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    known = definitions()
    keys = draw(st.lists(st.sampled_from(sorted(known)), unique=True, max_size=12))
    tables: dict[str, list[str]] = {}
    for key in keys:
        section, name = key.split(".")
        value = draw(raw_values(known[key].kind))
        tables.setdefault(section, []).append(f"{name} = {toml_value(value)}\n")
    routes = draw(st.none() | ROUTES)
    if routes is not None:
        tables["routes"] = [f"{toml_value(domain)} = {toml_value(route)}\n" for domain, route in routes.items()]
    return "".join(f"[{section}]\n" + "".join(lines) for section, lines in tables.items())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(config_texts())
def test_show_and_show_n_read_back_as_the_same_config(text: str) -> None:
    try:
        config = parse_config(text, "drawn.toml", base_dir=BASE)
    except ConfigError as e:  # a rule that spans settings (reserved_sessions, no route for the postmaster ...)
        assert e.key.startswith(("server.reserved_sessions", "relay.", "server.tls", "submission.", "egress.pools[",
                                 "egress.routes[", "egress.senders[", "egress.providers")), (e, text)
        assume(False)
        return
    same(show_config(config, base_dir=BASE), config)
    same(show_config(config, only_changed=True, base_dir=BASE), config)
