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

## The long fuzz (issue 18): hostile session files through replay/report/merge, and truncated
## netlink datagrams through the nf-trace and link decoders, with new seeds for FUZZ_SECONDS
## each (make test runs their fixed-seed subset). A failure names its seed:
## NPTRACE_FUZZ_SEED=<seed> replays it.
FUZZ_SECONDS ?= 300
.PHONY: fuzz
fuzz: setup
	NPTRACE_FUZZ_SECONDS=$(FUZZ_SECONDS) $(PYTEST) -q -s -p no:cacheprovider \
		tests/unit/test_fuzz_sessions.py tests/unit/test_fuzz_netlink.py tests/unit/test_fuzz_rules.py

bench: setup
	$(PY) -m nptrace.bench

bench-quick: setup
	$(PY) -m nptrace.bench --quick

lab-clean:
	-.venv/bin/nptrace lab down --all

clean: lab-clean
	rm -rf .venv *.egg-info .pytest_cache results build
	find nptrace -name '*.so' -delete
