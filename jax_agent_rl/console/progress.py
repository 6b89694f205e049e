"""What a long phase is doing and how far it is, on the console it is given.

On a terminal (``console.is_terminal``) a phase is a rich progress bar with its elapsed time.
Anywhere else (stdout to a log file) it is plain lines at a bounded rate: one when it starts,
one when an update comes at least ``every_s`` seconds after the last line (never a line per
update), a heartbeat with the elapsed time when nothing was printed for ``every_s`` seconds
(a compilation reports nothing while it runs), and one when it ends, with its duration. The
clock is passed in, so the rate is tested without waiting.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

Clock = Callable[[], float]
# a log file hears from a long phase this often (docs promise a line at least every 15 s: a
# busy host delays a tick; the help example at load 27 saw gaps of 15.2 s at 15)
EVERY_S = 10.0


class Phase:
    """A running phase: ``update(done, status)`` reports ``done`` of ``total`` units (or,
    without a total, only a new ``status``)."""

    def __init__(self, update: Callable[[int, str], None]) -> None:
        self._update = update
        self.done = 0

    def update(self, done: int, status: str = "") -> None:
        self.done = done
        self._update(done, status)

    def advance(self, status: str = "") -> None:
        self.update(self.done + 1, status)


def _count(label: str, done: int, total: int | None) -> str:
    return label if total is None else f"{label} {done}/{total}"


class _PlainLines:
    """The plain-line side of `phase`, for a console that is not a terminal."""

    def __init__(
        self,
        console: Console,
        label: str,
        total: int | None,
        clock: Clock,
        every_s: float,
        lines: bool,
    ) -> None:
        self.console, self.label, self.total = console, label, total
        self.clock, self.every_s, self.lines = clock, every_s, lines
        self.start = self.printed = clock()
        self.done, self.status = 0, ""
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.printed = self.clock()

    def now(self) -> str:
        status = f"  {self.status}" if self.status else ""
        elapsed = self.clock() - self.start
        return f"{_count(self.label, self.done, self.total)}{status}  ({elapsed:.0f} s)"

    def update(self, done: int, status: str) -> None:
        with self.lock:
            self.done, self.status = done, status
            if not self.lines:  # the caller printed its own line
                self.printed = self.clock()
            elif self.clock() - self.printed >= self.every_s:
                self.line(self.now())

    def heartbeat(self) -> None:
        """A line if nothing was printed for ``every_s`` seconds."""
        with self.lock:
            if self.clock() - self.printed >= self.every_s:
                self.line(self.now())

    def end(self) -> None:
        with self.lock:
            self.line(f"{self.now()}: done")


Ticker = Callable[[Callable[[], None], float], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def every_real(tick: Callable[[], None], every_s: float) -> Iterator[None]:
    """Calls ``tick`` every ``every_s`` seconds of real time (from a thread) while open."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            tick()

    thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def phase(
    console: Console,
    label: str,
    total: int | None = None,
    *,
    clock: Clock = time.monotonic,
    every_s: float = EVERY_S,
    ticker: Ticker = every_real,
    lines: bool = True,
) -> Iterator[Phase]:
    """A phase called ``label`` of ``total`` units (None: one piece of work, such as a
    compilation) on ``console`` (see the module docstring). ``ticker`` calls the heartbeat
    every ``every_s`` seconds while the phase runs; ``lines=False``, for a caller that prints a
    line of its own with each update, prints no update lines, and heartbeats only when the
    caller's last line is ``every_s`` seconds old."""
    if console.is_terminal:
        bar = Progress(
            SpinnerColumn() if total is None else BarColumn(),
            TextColumn("[bold]{task.description}"),
            *([] if total is None else [MofNCompleteColumn()]),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
        )
        with bar:
            task = bar.add_task(label, total=total, status="")
            yield Phase(lambda done, status: bar.update(task, completed=done, status=status))
        return
    plain = _PlainLines(console, label, total, clock, every_s, lines)
    plain.line(f"{_count(label, 0, total)}: started")
    with ticker(plain.heartbeat, every_s):
        yield Phase(plain.update)
    plain.end()


class CacheHits:
    """Counts the programs this process loads from JAX's persistent compilation cache from now
    until `close` (JAX's monitoring events), for a phase's progress lines."""

    _EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        import jax

        self.count = 0

        def listen(event: str, **_: object) -> None:
            if event == self._EVENT:
                self.count += 1

        self._listen = listen
        jax.monitoring.register_event_listener(listen)

    def close(self) -> None:
        import jax

        jax.monitoring.unregister_event_listener(self._listen)
