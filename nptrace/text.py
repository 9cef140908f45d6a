"""Text for a terminal: names from the node (interfaces, Services, rule text, paths) may hold
terminal escapes. Core, so every layer may use it: the console sink, the session commands and
the one error mapper (errors.py) print through it."""
from __future__ import annotations

# C0 controls (ESC starts a terminal escape sequence), DEL and the C1 controls (0x9b is a
# one-byte CSI on some terminals), and what str.isprintable() refuses besides: every one but
# newline is shown as \xNN / \uNNNN. An interface name may hold ESC (IFNAMSIZ bytes,
# anything but '/', NUL and whitespace), and so may a Service name, a rule's text or a path.
_ESCAPES: dict[int, str] = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]
                             if c != 0x0A}


def printable(text) -> str:
    """`text` safe for a terminal: control characters escaped (one helper for every text
    output: the console sink, replay/report/merge and their warnings)."""
    s = text if type(text) is str else str(text)
    if s.isprintable():
        return s
    s = s.translate(_ESCAPES)
    if s.replace("\n", "").isprintable():
        return s
    return "".join(c if c.isprintable() or c == "\n" else f"\\u{ord(c):04x}" for c in s)


def hostport(addr: str, port) -> str:
    """addr:port, IPv6 as [addr]:port (RFC 3986), for every text that joins the two: console
    lines, hints, JSON evidence details and the client/frontend/endpoint strings."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
