"""A SIGTERM ends the node within seconds, even while the agent's main thread is held in C++.

Python runs a signal handler only in the main thread, between two bytecodes. The node agent's
main thread waits in torch's rendezvous-store calls (joining, looking for waiting nodes), which
go on through a signal; when the store's host is gone (node 0's pod deleted first: its address
no longer answers), such a call returns only at the store's timeout, 60 s, and the pod held its
node for the whole grace period. CPython's own low-level handler still writes the signal's
number to the wakeup fd (:func:`signal.set_wakeup_fd`) the moment it arrives: the thread here
reads it, and if the Python handler has not run :data:`STUCK_SECONDS` later, it calls
``on_stuck``, which ends the node itself.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable

# The Python handler runs within milliseconds when the main thread runs Python at all: a
# SIGTERM it has not taken after this long finds the thread held in a call.
STUCK_SECONDS = 2.0  # not a hang guard: how long a handler that runs at all takes at most


class Watch:
    """The SIGTERM handler ``handler``, watched from a thread (start it in the main thread)."""

    def __init__(self, handler: Callable, on_stuck: Callable[[], None] | None = None):
        self.handler, self.on_stuck = handler, on_stuck
        self.handled = threading.Event()
        self._read, write = socket.socketpair()
        write.setblocking(False)  # as set_wakeup_fd requires: a full buffer never blocks
        self._write = write  # kept open as long as the watch
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        self.install()
        threading.Thread(target=self._run, daemon=True, name="ftjob-sigterm-watch").start()

    def install(self) -> None:
        """Put the watched handler (back) in place: torch's process context replaces it with
        its own when it starts the workers."""
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.handled.set()
        self.handler(signum, frame)

    def _run(self) -> None:
        while True:
            numbers = self._read.recv(64)  # every signal with a Python handler writes one
            if signal.SIGTERM in numbers and not self.handled.wait(STUCK_SECONDS):
                if self.on_stuck is not None:  # set as soon as the node knows its rank
                    self.on_stuck()
                return
