"""Signals over the tracer's whole life, and a stop whose steps cannot skip each other.

A SIGTERM (systemd stopping the unit, the kubelet deleting the pod) can come at any point:
during the slow compile, between two tc filters, or while the last clean-up runs. What a run
attached outlives the process (clsact filters, nft trace tables: tcx links and perf events die
with it), so:

- the handlers are installed at the first line of start() and stay until the last line of
  stop(); they only count (no exception thrown into whatever runs), and start() checks the
  count between its steps (`checkpoint`), so a signal during start-up stops it at the next
  step boundary and stop() detaches what was attached by then;
- stop() runs each clean-up step in its own guard (`run_steps`): a step that fails, or a second
  signal while it runs, does not skip the steps after it.
"""
from __future__ import annotations

import signal
import sys
from typing import Callable, Iterable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A stop signal arrived during start-up (raised at a step boundary by checkpoint)."""

    def __init__(self, signum: int, where: str):
        super().__init__(f"{signal.Signals(signum).name} during start-up ({where})")
        self.signum, self.where = signum, where


class Signals:
    """SIGINT/SIGTERM counted, SIGHUP flagged, from install() to restore()."""

    def __init__(self):
        self.count = 0
        self.last: int | None = None
        self.hup = False
        self._old: dict = {}
        self.on_again: Callable[[int], None] | None = None   # called for the 2nd, 3rd... signal

    def install(self) -> None:
        if self._old:
            return
        try:
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._stop)
            self._old[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._hup)
        except ValueError:      # not the main thread (a test driving a Tracer): no handlers
            self._old.clear()

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _stop(self, signum, _frame) -> None:
        self.count += 1
        self.last = signum
        if self.count > 1 and self.on_again is not None:
            self.on_again(signum)

    def _hup(self, _signum, _frame) -> None:
        self.hup = True

    @property
    def requested(self) -> bool:
        return self.count > 0

    def checkpoint(self, where: str) -> None:
        """Raise Interrupted if a stop signal came in: start-up calls this between steps."""
        if self.count:
            raise Interrupted(self.last or signal.SIGTERM, where)


def run_steps(steps: Iterable[tuple[str, Callable[[], object]]], log: Callable[[str], None]
              ) -> list[str]:
    """Run every step whatever the others do; returns the names of those that failed (each
    logged once). BaseException too: a KeyboardInterrupt inside one step (a handler not ours)
    must not skip the rest."""
    failed = []
    for name, fn in steps:
        try:
            fn()
        except BaseException as e:   # noqa: BLE001 - the point: nothing skips the next step
            failed.append(name)
            try:
                log(f"warning: stop step {name!r} failed: {type(e).__name__}: {e}")
            except BaseException:
                print(f"nptrace: stop step {name!r} failed", file=sys.stderr)
    return failed
