"""The bounce classifier (mta.bounce_class), sans IO: the shipped rules over real providers' replies, the
relay's own deferrals, an operator's rules before the shipped ones, and every bad rules file named in one line.

The reply texts are the providers' own, as their postmaster pages and operators' logs quote them (the
addresses in them replaced by documentation addresses).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from mta.bounce_class import CLASSES, Classifier, RulesError, classifier_for, default_rules, glob_regex, parse_rules
from mta.bounce_class.rules import rules_table
from mta.config import ConfigError, parse_config
from spool import Outcome, Status

REPLIES = [
    # Gmail
    (550, "5.1.1", "The email account that you tried to reach does not exist. Please try double-checking the "
                   "recipient's email address for typos or unnecessary spaces. - gsmtp", "bad-mailbox"),
    (452, "4.2.2", "The email account that you tried to reach is over quota. Please direct the recipient to "
                   "https://support.google.com/mail/?p=OverQuotaTemp - gsmtp", "mailbox-full"),
    (421, "4.7.28", "[192.0.2.1] Our system has detected an unusual rate of unsolicited mail originating from "
                    "your IP address. To protect our users from spam, mail sent from your IP address has been "
                    "temporarily rate limited. - gsmtp", "rate-limited"),
    (450, "4.2.1", "The user you are trying to contact is receiving mail at a rate that prevents additional "
                   "messages from being delivered. Please resend your message at a later time. - gsmtp",
     "rate-limited"),
    (421, "4.7.0", "[192.0.2.1] Our system has detected that this message is suspicious due to the very low "
                   "reputation of the sending domain. - gsmtp", "policy"),
    (421, "4.7.0", "TLS required for RCPT domain, closing connection. - gsmtp", "tls"),
    # Outlook / Microsoft
    (550, "5.7.1", "Unfortunately, messages from [192.0.2.1] weren't sent. Please contact your Internet service "
                   "provider since part of their network is on our block list (S3150).", "policy"),
    (451, "4.7.650", "The mail server [192.0.2.1] has been temporarily rate limited due to IP reputation. For "
                     "e-mail delivery information, see https://aka.ms/postmaster (S775)", "rate-limited"),
    (550, "5.5.0", "Requested action not taken: mailbox unavailable (S2017)", "bad-mailbox"),
    # Yahoo
    (421, "4.7.0", "[TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected volume or user "
                   "complaints - 4.16.55.1; see https://postmaster.yahooinc.com/error-codes", "rate-limited"),
    (554, "5.7.9", "Message not accepted for policy reasons.  See https://postmaster.yahooinc.com/error-codes",
     "policy"),
    # Enhanced codes alone (RFC 3463), with texts the rules do not know
    (550, "5.1.10", "RESOLVER.ADR.RecipientNotFound", "bad-mailbox"),
    (552, "5.2.2", "sorry", "mailbox-full"),
    (554, "5.7.0", "go away", "policy"),
    (451, "4.3.0", "Mail server temporarily rejected message.", "other"),
    # The relay's own deferrals (code 0: no reply), as smtp_transport and the scheduler word them
    (0, "4.4.1", "connect to mx.example.net[192.0.2.5]:25: connection refused", "connection"),
    (0, "4.4.1", "mx.example.net[192.0.2.5]:25: timed out while receiving the initial server greeting",
     "connection"),
    (0, "4.4.3", "DNS lookup of example.net failed: the resolver timed out", "dns"),
    (0, "5.1.2", "example.invalid: no such domain (NXDOMAIN)", "dns"),
    (0, "4.7.5", "mx.example.net[192.0.2.5]:25: TLS handshake failed: certificate verify failed", "tls"),
    (0, "4.7.4", "mx.example.net[192.0.2.5]:25: STARTTLS not offered, and this route requires TLS", "tls"),
    (0, "4.4.5", "every egress address of bulk is at its warm-up cap for today; the message waits", "rate-limited"),
    (0, "4.3.0", "local error: RuntimeError (routing)", "other"),
]


@pytest.mark.parametrize(("code", "enhanced", "text", "klass"), REPLIES)
def test_the_shipped_rules_class_real_replies(code: int, enhanced: str, text: str, klass: str) -> None:
    assert Classifier(default_rules()).classify(code, enhanced, text) == klass


def test_every_class_is_reached_and_every_shipped_rule_names_its_source() -> None:
    assert {klass for *_, klass in REPLIES} == set(CLASSES)
    assert all(rule.source for rule in default_rules())


def test_an_outcome_gets_a_class_only_when_it_did_not_deliver() -> None:
    classes = Classifier(default_rules())
    assert classes.of(Outcome("a@x.example", Status.DELIVERED, 250, "2.0.0", "ok")) is None
    assert classes.of(Outcome("a@x.example", Status.DELETED, 0, "", "deleted by the administrator")) is None
    expired = Outcome("a@x.example", Status.EXPIRED, 0, "4.4.7", "message expired after 5 days in the queue; last "
                      "error: 452 4.2.2 The email account that you tried to reach is over quota")
    assert classes.of(expired) == "mailbox-full"  # the last error it carries names the cause


def test_an_operators_rule_comes_before_the_shipped_ones(tmp_path: Path) -> None:
    rules = tmp_path / "classes.toml"
    rules.write_text('[[rule]]\nclass = "policy"\ncode = "45?"\ntext = "greylist"\n')
    mine = classifier_for(str(rules))
    assert mine.classify(451, "4.7.1", "Greylisted, please try again later") == "policy"
    assert mine.classify(550, "5.1.1", "no such user") == "bad-mailbox"  # the shipped rules still apply after it
    alone = classifier_for(str(rules), defaults=False)
    assert alone.classify(550, "5.1.1", "no such user") == "other"


@pytest.mark.parametrize(("text", "words"), [
    ('[[rule]]\nclass = "spam"\ntext = "x"', "rule[0].class: class must be one of"),
    ('[[rule]]\nclass = "policy"', "rule[0]: a rule needs at least one of"),
    ('[[rule]]\nclass = "policy"\ntext = "(unclosed"', "rule[0].text: not a regular expression"),
    ('[[rule]]\nclass = "policy"\ncode = 550', "rule[0].code: must be a string"),
    ('[[rule]]\nclass = "policy"\ncolour = "x"', "rule[0].colour: unknown key"),
    ('rules = 1', "unknown key 'rules'"),
    ('[[rule]\n', "not TOML"),
])
def test_a_bad_rules_file_is_named_in_one_line(text: str, words: str) -> None:
    with pytest.raises(RulesError) as caught:
        parse_rules(text, "classes.toml")
    assert str(caught.value).startswith("classes.toml: ") and words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_config_checks_the_rules_file_when_it_is_read(tmp_path: Path) -> None:
    rules = tmp_path / "classes.toml"
    rules.write_text('[[rule]]\nclass = "nope"\ntext = "x"\n')
    with pytest.raises(ConfigError) as caught:
        parse_config(f'[bounce_classes]\nrules_file = "{rules}"\n', source="relay.toml")
    assert "bounce_classes.rules_file" in str(caught.value) and "rule[0].class" in str(caught.value)
    rules.write_text('[[rule]]\nclass = "policy"\ntext = "x"\n')
    assert parse_config(f'[bounce_classes]\nrules_file = "{rules}"\n').bounce_classes.rules_file == str(rules)


@pytest.mark.parametrize("code", ["0", "250", "421", "451", "550", "4.7.28", "5.1.10", "4.4.1", "2.0.0", "5.7.650"])
def test_a_pattern_read_as_a_regular_expression_matches_what_fnmatch_matches(code: str) -> None:
    """The Spark report classes by ``glob_regex`` (Java's rlike), the relay by fnmatch: they must agree."""
    patterns = [rule.code or rule.enhanced for rule in default_rules() if rule.code or rule.enhanced]
    patterns += ["4??", "5.7.*", "?.[14].[234]"]
    for pattern in patterns:
        assert bool(re.search(glob_regex(pattern), code)) == fnmatch.fnmatchcase(code, pattern), pattern


def test_the_manuals_table_is_the_shipped_rules() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text(encoding="utf-8")
    begin = "<!-- bounce classes: checked by tests/bounce_class/test_bounce_class.py -->\n"
    table = doc.split(begin, 1)[1].split("<!-- end bounce classes -->", 1)[0]
    assert table == rules_table(default_rules())
