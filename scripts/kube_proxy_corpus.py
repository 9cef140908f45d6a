#!/usr/bin/env python3
"""Extract the expected rulesets of kube-proxy's own unit tests into corpus fixtures.

Reads ``pkg/proxy/iptables/proxier_test.go`` and ``pkg/proxy/nftables/proxier_test.go`` of a
kubernetes/kubernetes checkout (or any excerpt of them) and writes, for each ``dedent.Dedent(`...`)``
string literal inside a ``func TestXxx`` that holds a ruleset (``*filter``/``*nat`` for iptables,
``add table``/``table ip``/``add rule`` for nftables):

    <outdir>/<TestName>[-<case>][-<role>].rules|.nft   the dedented text, with a ``# source:`` header
    <outdir>/<TestName>[-<case>].flows.json            the ``packetFlowTest`` entries that follow it

The ruleset is data kube-proxy's tests assert; this script is ours. ``<case>`` is the ``name:``
of the table-driven case the literal sits in (slugged), ``<role>`` the Go identifier it is
assigned to when that is not ``expected`` (``input``, ``output`` ...). Go constants of the file
(``testNodeIP = "192.168.0.2"``) are resolved in the flows.

    python3 scripts/kube_proxy_corpus.py --source kubernetes/kubernetes@<commit> \\
        pkg/proxy/iptables/proxier_test.go tests/fixtures/kube-proxy/corpus
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

_FUNC = re.compile(r"^func (Test\w+)\(", re.M)
_DEDENT = re.compile(r"dedent\.Dedent\(`(.*?)`\)", re.S)
# a package-level ruleset prefix, e.g. nftables' ``var baseRules = dedent.Dedent(`...`)``
_PREFIX_VAR = re.compile(r"^(?:var\s+)?(\w+)\s*(?::=|=)\s*dedent\.Dedent\(`(.*?)`\)", re.S | re.M)
_PREFIXED = re.compile(r"(\w+)\s*\+\s*$")
_CONST = re.compile(r'^\s*(?:const\s+)?(\w+)\s*=\s*"([^"]*)"\s*$', re.M)
_CASE_NAME = re.compile(r'\bname:\s*"([^"]+)"')
_ASSIGN = re.compile(r"(\w+)\s*(?::=|=|:)\s*$")
_FLOWS = re.compile(r"runPacketFlowTests\(.*?\[\]packetFlowTest\{(.*?)\n\t\}\)", re.S)
_FLOW_FIELD = re.compile(r"(\w+):\s*(\"[^\"]*\"|[\w.]+),")


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower()


def kind_of(text: str) -> str | None:
    head = text.lstrip()
    if head.startswith(("*filter", "*nat", "*mangle")):
        return "rules"
    if head.startswith(("add table", "table ip", "table inet", "add chain", "add rule")):
        return "nft"
    return None


def _value(tok: str, consts: dict[str, str]):
    if tok.startswith('"'):
        return tok[1:-1]
    if tok in ("true", "false"):
        return tok == "true"
    if tok.isdigit():
        return int(tok)
    return consts.get(tok, tok)


def parse_flows(block: str, consts: dict[str, str]) -> list[dict]:
    """The ``{ name: ..., sourceIP: ... }`` entries of one ``[]packetFlowTest{...}`` literal."""
    flows, depth, cur = [], 0, ""
    for ch in block:
        if ch == "{":
            depth += 1
            if depth == 1:
                cur = ""
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                flows.append({k: _value(v, consts) for k, v in _FLOW_FIELD.findall(cur + ",")})
                continue
        if depth >= 1:
            cur += ch
    return flows


def extract(go: str, source: str, path: str):
    """Yield (filename, text) for every ruleset and flow list in one Go test file."""
    consts = dict(_CONST.findall(go))
    first = _FUNC.search(go)
    prefixes = {k: textwrap.dedent(v).strip("\n") + "\n"
                for k, v in _PREFIX_VAR.findall(go[: first.start() if first else len(go)])}
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(go)] + [(len(go), "")]
    for (start, test), (end, _) in zip(starts, starts[1:]):
        body = go[start:end]
        seen: dict[str, int] = {}
        last_name = None
        for m in _DEDENT.finditer(body):
            text = textwrap.dedent(m.group(1)).strip("\n") + "\n"
            before = body[:m.start()]
            p = _PREFIXED.search(before)
            if p is not None and p.group(1) in prefixes:     # ``expected := baseRules + dedent...``
                text = prefixes[p.group(1)] + "\n" + text
                before = before[:p.start()]
            kind = kind_of(text)
            if kind is None:
                continue
            cases = _CASE_NAME.findall(before)
            case = slug(cases[-1]) if cases else ""
            a = _ASSIGN.search(before.rstrip()[-80:] if before.rstrip() else "")
            role = a.group(1) if a else ""
            if before.rstrip().endswith("ParseDump("):      # the state a test loads before syncing
                role = "input"
            parts = [test, case, "" if role in ("expected", "rules", "expectedRules") else slug(role)]
            stem = "-".join(p for p in parts if p)
            n = seen.get(stem, 0) + 1
            seen[stem] = n
            if n > 1:
                stem = f"{stem}-{n}"
            header = f"# source: {source} {path} {test}" + (f" case {cases[-1]!r}" if cases else "") + "\n"
            yield f"{stem}.{kind}", header + text
            last_name = stem
            # the packet flows a TestTracePacket-style test asserts against this ruleset
            after = body[m.end():]
            nxt = _DEDENT.search(after)
            fm = _FLOWS.search(after[: nxt.start() if nxt else len(after)])
            if fm is not None and last_name is not None:
                flows = parse_flows(fm.group(1), consts)
                if flows:
                    doc = {"source": f"{source} {path} {test}", "flows": flows}
                    yield f"{stem}.flows.json", json.dumps(doc, indent=1) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="repo@commit the file came from")
    ap.add_argument("--path", help="the file's path in that repo (default: as given)")
    ap.add_argument("gofile", type=Path)
    ap.add_argument("outdir", type=Path)
    a = ap.parse_args(argv)
    a.outdir.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, text in extract(a.gofile.read_text(), a.source, a.path or str(a.gofile)):
        (a.outdir / name).write_text(text)
        print(name)
        n += 1
    print(f"{n} files", file=sys.stderr)
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
