# nptrace. Everything runs as root (BPF, network namespaces); `make setup` is idempotent.
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest
DEMO    ?= no-listener

.PHONY: setup demo test test-unit test-privileged bench bench-quick clean lab-clean

setup:
	bash scripts/setup.sh

## The README's first command: set up, then trace a lab scenario and print its labeled events.
demo: setup
	$(PY) -m nptrace.lab.demo $(DEMO)

## The README's second command (and .ci/run): set up, then every test (unit + privileged).
test: setup
	$(PYTEST) -ra tests/unit tests/privileged

test-unit: setup
	$(PYTEST) -q tests/unit

test-privileged: setup
	$(PYTEST) -ra tests/privileged

bench: setup
	$(PY) -m nptrace.bench

bench-quick: setup
	$(PY) -m nptrace.bench --quick

lab-clean:
	-.venv/bin/nptrace lab down --all

clean: lab-clean
	rm -rf .venv *.egg-info .pytest_cache results
