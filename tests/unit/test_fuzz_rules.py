"""The kube-proxy rule parsers (services: parse_iptables_save, parse_nft) never raise on a
damaged or crafted dump: seeded mutations of tests/fixtures/kube-proxy (lines dropped, doubled,
cut, shuffled; hostile tokens spliced in: bare counters, non-ASCII digits, braces, control
characters) plus known crash inputs. A parser may ignore what it cannot read; it
must return a ServiceMap. NPTRACE_FUZZ_SECONDS (make fuzz) runs new seeds for that long."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from nptrace.services.iptables import parse_iptables_save
from nptrace.services.nft import parse_nft

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kube-proxy"
CASES = int(os.environ.get("NPTRACE_FUZZ_CASES", "240"))
SECONDS = float(os.environ.get("NPTRACE_FUZZ_SECONDS", "0"))
TOKENS = ["[0:0]", "[", "]", "²", "٣", "\u00b9\u00b2", "{", "}", "{ {", "\x1b[31m", "\x00",
          "-A", "-A KUBE-SERVICES", "-I KUBE-X ²", ":KUBE-X - [0:0]", "*nat", "COMMIT",
          "# handle ²", "# handle", "dport ²", ":²", "10.0.0.1:²", "[fd00::1]:", "elements = {",
          "table ip kube-proxy {", "map service-ips {", "tcp dport 30080 . ²", '"', "\\",
          "--dport", "-m comment --comment", "-j", "-j DNAT --to-destination 1.2.3.4:²"]


def fixtures() -> list[tuple[str, str]]:
    out = []
    for p in sorted(FIX.rglob("*")):
        if p.is_file() and p.suffix in (".rules", ".nft"):
            out.append((p.suffix, p.read_text(errors="replace")))
    return out


FIXTURES = fixtures()


def mutate(rng: random.Random, text: str) -> str:
    lines = text.splitlines()
    for _ in range(rng.randint(1, 6)):
        if not lines:
            lines = [""]
        op = rng.randrange(7)
        i = rng.randrange(len(lines))
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[i])
        elif op == 2:
            lines[i] = lines[i][:rng.randrange(len(lines[i]) + 1)]
        elif op == 3:
            lines.insert(i, rng.choice(TOKENS))
        elif op == 4:
            ln = lines[i]
            k = rng.randrange(len(ln) + 1)
            lines[i] = ln[:k] + rng.choice(TOKENS) + ln[k:]
        elif op == 5:
            rng.shuffle(lines)
        else:
            ln = lines[i]
            if ln:
                k = rng.randrange(len(ln))
                lines[i] = ln[:k] + chr(rng.choice([0, 0x1b, 0xb2, 0x663, 0xff10, 0x7b, 0x7d])) + ln[k + 1:]
    return "\n".join(lines) + rng.choice(["", "\n"])


def _parse(kind: str, text: str):
    return parse_iptables_save(text) if kind == ".rules" else parse_nft(text)


@pytest.mark.parametrize("text", ["*nat\n[0:0]\nCOMMIT\n", "[0:0]", "*nat\n[1:2]   \n",
                                  "*nat\n-A KUBE-SVC-X -d 10.0.0.1/32 -p tcp --dport ² -j DNAT "
                                  "--to-destination 10.244.0.5:²\nCOMMIT\n"])
def test_crashers_of_the_iptables_parser(text):
    _parse(".rules", text)


@pytest.mark.parametrize("text", [
    "table ip kube-proxy {\n map service-ips {\n  elements = { 10.0.0.1 . tcp . ² : goto x }\n }\n}\n",
    "table ip kube-proxy {\n chain x {\n  ip daddr 10.0.0.1 drop # handle ²\n }\n}\n",
])
def test_crashers_of_the_nft_parser(text):
    _parse(".nft", text)


def _fuzz(seeds) -> None:
    assert FIXTURES, f"no fixtures under {FIX}"
    for seed in seeds:
        rng = random.Random(seed)
        kind, text = FIXTURES[seed % len(FIXTURES)]
        bad = mutate(rng, text)
        try:
            _parse(kind, bad)
        except Exception as e:   # pragma: no cover - the failure names its seed
            raise AssertionError(f"seed {seed} ({kind}): {type(e).__name__}: {e}") from e


def test_fuzz_rule_parsers_fixed_seeds():
    seed = os.environ.get("NPTRACE_FUZZ_SEED")
    _fuzz([int(seed)] if seed else range(CASES))


@pytest.mark.skipif(not SECONDS, reason="the long fuzz: make fuzz (NPTRACE_FUZZ_SECONDS)")
def test_fuzz_rule_parsers_long():
    start = random.randrange(10**9)
    deadline = time.monotonic() + SECONDS
    n = 0
    while time.monotonic() < deadline:
        _fuzz(range(start + n, start + n + 100))
        n += 100
    print(f"\nfuzzed {n} rule dumps from seed {start}")
