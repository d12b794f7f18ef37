# The two commands the README promises: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
SYS_STAMP := .sysdeps-installed
SYSTEM_PACKAGES := swaks postfix strace default-jre-headless

.PHONY: run test lint typecheck imports pytest spark-test sysdeps crashtest bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[spark]'
	touch $@

$(DEV_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(STAMP)

run: $(STAMP)
	$(BIN)/mta serve

# System packages the tests use as real peers: swaks (client), Postfix's
# smtp-source/smtp-sink, strace, and a Java runtime for Spark.
sysdeps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "postfix postfix/main_mailer_type select No configuration" | $$SUDO debconf-set-selections; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

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
	$(BIN)/python -m fault_injection kill9 --cycles 500
	$(BIN)/python -m fault_injection kill9 --relay --cycles 500
	$(BIN)/python -m fault_injection corrupt --cases 80
	$(BIN)/python -m fault_injection faults --sweep 6
	$(BIN)/python -m fault_injection.fuzz_decoder -max_total_time=600

bench: $(DEV_STAMP)
	$(BIN)/python tools/bench/spool_bench.py
