"""The tree says the architecture: probes (kernel/) -> decode (events.py) -> attribution
(classify/, with node/ and services/ beside it) -> sinks/ -> sessions/ -> entry points. This
test reads every module's imports (lazy ones inside functions too) and fails on an import
circle, on an import from a higher layer into a lower one, and on a reach into another
module's private names; and it imports every module alone, without bcc or pyroute2."""
from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "nptrace"

# Lowest first: a module may import its own layer and the layers before it, never a later one.
# sessions.format is the session file layout, which the recorder sink writes and the session
# readers read: a shared layout like events.py, so it sits in the core.
LAYERS = (
    ("core", ("nptrace", "nptrace.errors", "nptrace.config", "nptrace.events", "nptrace.reasons",
              "nptrace.names", "nptrace.counters", "nptrace.sessions.schema",
              "nptrace.sessions.framing", "nptrace.sessions.header", "nptrace.sessions.lookups",
              "nptrace.sessions.reader", "nptrace.sessions.writer", "nptrace.sessions.format")),
    ("kernel", ("nptrace.kernel",)),
    ("services", ("nptrace.services",)),
    ("node", ("nptrace.node",)),
    ("classify", ("nptrace.classify",)),
    ("sinks", ("nptrace.sinks",)),
    ("sessions", ("nptrace.sessions",)),
    ("lab", ("nptrace.lab",)),
    ("entry", ("nptrace.daemon", "nptrace.doctor", "nptrace.explain", "nptrace.cli")),
    ("bench", ("nptrace.bench",)),
)
# the only importers of bcc and pyroute2 (STYLE.md 1)
BCC_IMPORTER, PYROUTE2_IMPORTER = "nptrace.kernel.loader", "nptrace.kernel.netlink"


def _modules() -> dict[str, Path]:
    """Every module by name: the .py files (the compiled ones are the same sources)."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _target(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(name: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(module imported, names taken from it, line) for every import in the module."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names if a.name.startswith("nptrace")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("nptrace"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:      # `from nptrace.kernel import btf`: the module btf
                    out.append((sub, (), node.lineno))
                else:
                    out.append((mod, (a.name,), node.lineno))
    return out


GRAPH = {m: {_target(t) for t, _, _ in _imports(m)} - {m} for m in MODULES}


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS"
    return rank


def test_every_module_is_in_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_import_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles = []

    def visit(v: str) -> None:       # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))
    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


def test_no_upward_import():
    bad = []
    for m in MODULES:
        for t, _, line in _imports(m):
            t = _target(t)
            if t != m and _layer(t) > _layer(m):
                bad.append(f"{MODULES[m].relative_to(PKG.parent)}:{line} {m} "
                           f"({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_no_reach_into_private_names():
    bad = []
    for m in MODULES:
        for t, names, line in _imports(m):
            if _target(t) == m:
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{MODULES[m].relative_to(PKG.parent)}:{line} takes {t}.{n}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _import_alone(name: str) -> tuple[str, int, str]:
    code = ("import sys, importlib; importlib.import_module(%r); "
            "bad = [m for m in ('bcc', 'pyroute2') if m in sys.modules]; "
            "print(','.join(bad))" % name)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=PKG.parent)
    return name, r.returncode, (r.stdout.strip() if r.returncode == 0 else r.stderr.strip())


def test_every_module_imports_alone_without_bcc_or_pyroute2():
    names = sorted(m for m in MODULES if not m.endswith("__main__"))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_import_alone, names))
    failed = [f"{n}: {out.splitlines()[-1] if out else rc}" for n, rc, out in results if rc]
    assert not failed, "modules that do not import on their own:\n" + "\n".join(failed)
    heavy = [f"{n} pulls in {out}" for n, rc, out in results
             if not rc and out and n not in (BCC_IMPORTER, PYROUTE2_IMPORTER)]
    assert not heavy, "\n".join(heavy)


@pytest.mark.parametrize("module,lib", [(BCC_IMPORTER, "bcc"), (PYROUTE2_IMPORTER, "pyroute2")])
def test_one_importer_per_library(module, lib):
    users = []
    for m, p in MODULES.items():
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(x == lib or x.startswith(lib + ".") for x in mods):
                users.append(m)
    assert set(users) <= {module} | {m for m in users if m.startswith("nptrace.bench")}, users


def test_test_modules_have_unique_basenames():
    """tests/ has no __init__.py: pytest imports test files by basename, so two of one name
    (one unit, one privileged) stop `make test` at collection."""
    seen: dict[str, Path] = {}
    dup = []
    for p in sorted((PKG.parent / "tests").rglob("test_*.py")):
        if p.name in seen:
            dup.append(f"{seen[p.name]} and {p}")
        seen.setdefault(p.name, p)
    assert not dup, dup
