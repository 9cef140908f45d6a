# nptrace. Everything runs as root (BPF, network namespaces); `make setup` is idempotent.
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest
DEMO    ?= no-listener

.PHONY: setup demo test test-all test-unit test-privileged sanitize bench bench-quick clean lab-clean

setup:
	bash scripts/setup.sh

## A root-owned, non-editable copy in /opt/nptrace for the systemd unit (scripts/install.sh)
.PHONY: install
install:
	bash scripts/install.sh

## The README's first command: set up, then trace a lab scenario and print its labeled events.
demo: setup
	$(PY) -m nptrace.lab.demo $(DEMO)

## The README's second command (and .ci/run): set up, then every test (unit + privileged)
## but the few that run for minutes (marked long: a bench run, the soak, the container image
## build), which test-all adds. Two pytest-xdist workers: one runs the privileged tests one
## after another (they share the node's lock and kernel state: tests/conftest.py), the other
## the unit tests meanwhile.
XDIST := -n 2
test: setup
	$(PYTEST) -ra $(XDIST) -m "not long" tests/privileged tests/unit

test-all: setup
	$(PYTEST) -ra $(XDIST) tests/privileged tests/unit

test-unit: setup
	$(PYTEST) -q tests/unit

## The hot path's Cython modules rebuilt with ASan + UBSan into build/asan/ (the extensions
## beside the sources stay the normal build), and their unit tests run on that build; any
## sanitizer report fails it, and a missing gcc, libasan or Cython exits 2 (scripts/sanitize.sh).
sanitize: setup
	bash scripts/sanitize.sh

test-privileged: setup
	$(PYTEST) -ra tests/privileged

## The long fuzz: hostile session files through replay/report/merge, and truncated
## netlink datagrams through the nf-trace and link decoders, with new seeds for FUZZ_SECONDS
## each (make test runs their fixed-seed subset), and the allocation bombs at the largest frame
## a session may hold (64 MiB; make test: 2 MiB). A failure names its seed:
## NPTRACE_FUZZ_SEED=<seed> replays it.
FUZZ_SECONDS ?= 300
.PHONY: fuzz
fuzz: setup
	NPTRACE_FUZZ_SECONDS=$(FUZZ_SECONDS) NPTRACE_FUZZ_BOMB_MB=64 $(PYTEST) -q -s -p no:cacheprovider \
		tests/unit/test_fuzz_sessions.py tests/unit/test_fuzz_netlink.py tests/unit/test_fuzz_rules.py

## The kernel matrix: Debian's 6.12, 6.1 and 5.10 kernels (trixie, bookworm, bullseye) booted
## under qemu (virtme-ng; KVM where a guest really runs under it, else TCG), nptrace doctor and
## every lab scenario inside each; the table goes to docs/kernels.md. KERNELS="6.12" picks
## kernels; SCENARIOS some scenarios. test-kernels-short is .ci/run's subset: doctor and three
## scenarios on 6.1.
KERNELS ?= 6.12 6.1 5.10
SCENARIOS ?=
.PHONY: test-kernels test-kernels-short
test-kernels: setup
	$(PY) -m nptrace.lab.kernels $(foreach k,$(KERNELS),--kernel $(k)) --markdown docs/kernels.md $(SCENARIOS)

test-kernels-short: setup
	$(PY) -m nptrace.lab.kernels --short

## The Vagrant lab booted for real (vagrant/README.md): a libvirt box built here from Debian's
## archive, the default profile's four VMs up and provisioned as the Vagrantfile does, three
## scenarios traced by nptrace on node1; every VM and network destroyed after, even on failure.
## libvirt's driver is NPTRACE_LIBVIRT_DRIVER, qemu (TCG) unless set. Not in .ci/run: it takes
## long on two cores. The table goes to docs/vagrant-smoke.md.
.PHONY: vagrant-smoke
vagrant-smoke: setup
	$(PY) -m nptrace.lab.vmsmoke --markdown docs/vagrant-smoke.md $(SCENARIOS)

## Kubernetes' own components for the lab's real tier (nptrace/lab/real/, docs/k8s.md): the
## releases pinned in k8s/releases built from the Go module proxy into NPTRACE_K8S_CACHE
## (default /var/lib/nptrace/k8s), from the go.mod and go.sum kept in k8s/<version>/; a
## release already built from the same pins is found, not rebuilt. K8S_RELEASES picks some.
K8S_RELEASES ?=
.PHONY: k8s test-k8s test-k8s-short  # test-k8s-ipvs below
k8s:
	bash k8s/build.sh $(K8S_RELEASES)

## The real tier's yardstick: every service-proxy scenario with a real control plane and one
## real kube-proxy per lab node, in iptables and nftables mode, scored per connection; the
## table goes to docs/k8s.md. test-k8s-short is .ci/run's form: one release, three scenarios.
test-k8s: setup k8s
	$(PY) -m nptrace.lab.real.yardstick --release current --release older --form lab --form plain \
		--form node --markdown docs/k8s.md
	$(PYTEST) -ra tests/k8s

test-k8s-short: setup
	$(PY) -m nptrace.lab.real.yardstick --release current no-listener etp-local-no-endpoint no-endpoints

## The shipped form's yardstick: every generated-tier scenario traced as a node runs nptrace
## (one plain `nptrace run` in each lab node's namespace), scored per connection, here and in
## Debian's 6.12, 6.1 and 5.10 under qemu (hours under TCG); the table goes to docs/shipped.md.
.PHONY: test-shipped
test-shipped: setup
	$(PY) -m nptrace.lab.shipped --markdown docs/shipped.md
	$(PY) -m nptrace.lab.shipped --kernel 6.12 --kernel 6.1 --kernel 5.10 --markdown docs/shipped.md

## kube-proxy's IPVS mode on the real tier, in Debian's 6.1 under qemu (this kernel has no
## IPVS): five scenarios, 7-13 minutes each under TCG; its rows join docs/k8s.md's table.
.PHONY: test-k8s-ipvs
test-k8s-ipvs: setup k8s
	$(PY) -m nptrace.lab.real.yardstick --kernel 6.1 --mode ipvs --release current --markdown docs/k8s.md \
		no-listener etp-local-no-endpoint no-endpoints stale-endpoint rollout-in-flight

bench: setup
	$(PY) -m nptrace.bench

bench-quick: setup
	$(PY) -m nptrace.bench --quick

lab-clean:
	-.venv/bin/nptrace lab down --all

clean: lab-clean
	rm -rf .venv *.egg-info .pytest_cache results build
	find nptrace -name '*.so' -delete
