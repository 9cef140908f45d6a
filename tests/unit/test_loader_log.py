"""What a failed BPF compile shows the user (loader._tail): the error, not only clang's notes."""
from nptrace.kernel.loader import _tail


def test_a_compile_error_is_shown_before_the_notes_that_follow_it():
    log = "\n".join(["x.h:1:2: warning: attribute ignored",
                     "/virtual/main.c:163:20: error: no member named 'ringbuf_query'"]
                    + [f"    note {i}: expanded from macro" for i in range(30)]
                    + ["2 warnings and 1 error generated."])
    shown = _tail(log).splitlines()
    assert len(shown) == 12 and "error: no member named 'ringbuf_query'" in shown[0]
    assert shown[-1] == "2 warnings and 1 error generated."
    assert not any("warning:" in ln for ln in shown)
    assert _tail("a\nb\nc", 2) == "b\nc"      # no error line: the last lines, as before
