"""A test that runs past its limit ends, whatever thread it hangs in.

pytest-timeout's signal method raises in the main thread when SIGALRM arrives, which
Python runs only between bytecodes of that thread. A hang inside an interpret-mode Pallas
kernel is elsewhere: XLA runs the program's host callbacks (the interpreter's loads,
stores, DMAs and semaphore waits, a user's ``jax.pure_callback``) on a thread of its own
while the main thread waits in native code for the result, so the alarm never lands
(a kernel followed by a callback that never returns runs past its limit until something
outside the test kills it).

The watchdog is a second, hard deadline on a thread of its own: armed with the test's
limit, it fires at ``limit * (1 + GRACE)``, after the signal had its chance. Firing is the
caller's to define (``attncheck.session.GateSession``): the case in flight gets its error record,
every thread's stack goes to the process' faults file, and the process ends; under xdist
the controller replaces the worker and the run goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# The hard deadline is the limit plus this share of it: inside twice the limit, and long
# enough that a timeout the signal can deliver ends the test first.
GRACE = 0.5
# The exit status of a process ended by the watchdog (pytest-timeout's thread method uses 1).
EXIT_STATUS = 70


class Watchdog:
    """One test at a time: ``arm`` when it starts, ``disarm`` when it ends; ``on_expiry``
    is called on the watchdog's thread with the test and its limit if it does not end in
    time."""

    def __init__(self, on_expiry: Callable[[str, float], None]):
        self._on_expiry = on_expiry
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def arm(self, test: str, limit_s: float) -> None:
        with self._lock:
            self._cancel()
            timer = threading.Timer(limit_s * (1 + GRACE), self._on_expiry, (test, limit_s))
            timer.name = f"attncheck watchdog: {test}"
            timer.daemon = True  # never keeps a finished process alive
            self._timer = timer
            timer.start()

    def disarm(self) -> None:
        with self._lock:
            self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
