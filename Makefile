# The two commands the README promises: `make run` and `make test`; and `make report`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# constraints.txt: the tested versions of every dependency (its header says why and how to refresh it).
PIP := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed
REPORT_STAMP := $(VENV)/.installed-report
DEV_STAMP := $(VENV)/.installed-dev
SYSTEM_PACKAGES := swaks curl postfix strace default-jre-headless unbound ldnsutils chromium \
	rspamd redis-server opendkim opendkim-tools dovecot-core dovecot-lmtpd postgrey haproxy python3-milter \
	libidn12

.PHONY: run report test lint typecheck imports pytest spark-test sysdeps crashtest bench

# The relay alone (trio, attrs, cbor2, click, crc32c, dnspython, prometheus-client, rich): no Spark,
# whose pyspark alone is ~490 MB; `make report` adds it, `make test` adds it and the test tools.
$(STAMP): pyproject.toml constraints.txt setup.py mta/dkim/_canon.c
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "make run: installing the relay into $(VENV) (the report's Spark is 'make report')"
	@$(PIP) -e .
	@touch $@

$(REPORT_STAMP): pyproject.toml constraints.txt setup.py mta/dkim/_canon.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -e '.[spark]'
	touch $@ $(STAMP)

$(DEV_STAMP): pyproject.toml constraints.txt setup.py mta/dkim/_canon.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	touch $@ $(STAMP) $(REPORT_STAMP)

# The relay on its built-in defaults in this directory; its first log lines say where the spool and
# the maildir are. No shutdown path: Ctrl-C (or kill -9) ends it and the next start recovers.
run: $(STAMP)
	@echo "make run: a test message: swaks --server 127.0.0.1:2525 --to you@localhost"
	@echo "          or: echo 'Subject: test' | curl -sS --crlf smtp://127.0.0.1:2525 --mail-from me@localhost --mail-rcpt you@localhost -T -"
	@echo "          then: ls var/maildir/you/new/; $(BIN)/mta queue list"
	@exec $(BIN)/mta serve

# The delivery report (pflogsumm-style, docs/report.md) on Spark in local mode: it needs a Java runtime
# (`make sysdeps` installs one). REPORT_INPUT: spool or archive directories; REPORT_OUT: where it goes.
REPORT_INPUT ?= var/spool
REPORT_OUT ?= var/report
report: $(REPORT_STAMP)
	$(BIN)/mta report --input $(REPORT_INPUT) --out $(REPORT_OUT)

# System packages the tests use as real peers: swaks and curl (clients), Postfix's
# smtp-source/smtp-sink, strace, a Java runtime for Spark, unbound with ldnsutils (a validating
# resolver over a zone signed by ldns-signzone, for the DANE tests), Chromium (the HTML report in a browser),
# and the mail stack the relay plugs into: rspamd (with redis-server), OpenDKIM, Dovecot's LMTP,
# postgrey, haproxy, and python3-milter (libmilter's Python binding, for the tests' own milter).
# libidn12: a library Exim links; Exim itself is never installed (apt would remove Postfix for it):
# tools/exim_unpack.sh unpacks Debian's exim4-daemon-light into var/exim, for the tests that send with it.
# A policy-rc.d that says no keeps the packages from starting their own services on install: each test
# starts its own instance.
sysdeps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "postfix postfix/main_mailer_type select No configuration" | $$SUDO debconf-set-selections; \
		made=""; if [ ! -e /usr/sbin/policy-rc.d ]; then made=1; \
			printf '#!/bin/sh\nexit 101\n' | $$SUDO tee /usr/sbin/policy-rc.d >/dev/null; $$SUDO chmod 755 /usr/sbin/policy-rc.d; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
		status=$$?; [ -z "$$made" ] || $$SUDO rm -f /usr/sbin/policy-rc.d; [ $$status = 0 ] || exit $$status; \
	fi; \
	SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO tools/exim_unpack.sh var/exim

lint: $(DEV_STAMP)
	$(BIN)/ruff check spool mta fault_injection tests tools

# mypy --strict on every folder ([tool.mypy] files in pyproject.toml).
typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# The import rules of [tool.importlinter] in pyproject.toml (import-linter).
imports: $(DEV_STAMP)
	$(BIN)/lint-imports

# The Spark tests share one local SparkSession; they take several minutes on a
# 2-core machine (most of it the JVM starting and planning), and run with the rest.
SPARK_TESTS := tests/report

pytest: $(DEV_STAMP) sysdeps
	$(BIN)/pytest -q --durations=25

spark-test: $(DEV_STAMP) sysdeps
	$(BIN)/pytest -q $(SPARK_TESTS)

test: sysdeps $(DEV_STAMP) lint typecheck imports pytest

crashtest: $(DEV_STAMP)
	$(BIN)/python -m fault_injection powercut --max-states 5000
	$(BIN)/python -m fault_injection relaycrash --states 20000
	$(BIN)/python -m fault_injection kill9 --cycles 500
	$(BIN)/python -m fault_injection kill9 --relay --cycles 500
	$(BIN)/python -m fault_injection corrupt --cases 80
	$(BIN)/python -m fault_injection faults --sweep 6
	$(BIN)/python -m fault_injection.fuzz_decoder -max_total_time=600

bench: $(DEV_STAMP)
	$(BIN)/python tools/bench/spool_bench.py
