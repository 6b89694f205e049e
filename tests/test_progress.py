"""A long phase on a console that is not a terminal (a log file): plain lines with counts, at
most one per ``every_s`` seconds of the clock passed in, a heartbeat when nothing was printed
for that long, and a line at each end; on a terminal, a progress bar."""

import contextlib
import io
from collections.abc import Callable, Iterator

from rich.console import Console

from jax_agent_rl.console.progress import phase


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeTicker:
    """Holds the heartbeat a phase would call every ``every_s`` seconds; the test calls it."""

    def __init__(self) -> None:
        self.tick: Callable[[], None] = lambda: None
        self.every_s = 0.0

    @contextlib.contextmanager
    def __call__(self, tick: Callable[[], None], every_s: float) -> Iterator[None]:
        self.tick, self.every_s = tick, every_s
        yield
        self.tick = lambda: None


def log_console() -> tuple[Console, io.StringIO]:
    log = io.StringIO()
    return Console(file=log, force_terminal=False, width=200), log


def test_a_log_file_gets_counted_lines_at_a_bounded_rate() -> None:
    console, log = log_console()
    clock, ticker = FakeClock(), FakeTicker()
    with phase(console, "sft step", 10, clock=clock, every_s=15.0, ticker=ticker) as bar:
        assert ticker.every_s == 15.0
        for step in range(10):
            clock.now += 4.0  # a step every 4 s: a line every 4th step (16 s after the last)
            bar.update(step + 1, f"loss {1.0 / (step + 1):.3f}")
    assert log.getvalue().splitlines() == [
        "sft step 0/10: started",
        "sft step 4/10  loss 0.250  (16 s)",
        "sft step 8/10  loss 0.125  (32 s)",
        "sft step 10/10  loss 0.100  (40 s): done",
    ]


def test_a_silent_phase_gets_a_heartbeat_only_when_nothing_was_printed_for_every_s() -> None:
    console, log = log_console()
    clock, ticker = FakeClock(), FakeTicker()
    with phase(console, "compiling", clock=clock, every_s=15.0, ticker=ticker):
        clock.now = 14.0
        ticker.tick()  # 14 s since the start line: quiet
        clock.now = 15.0
        ticker.tick()
        clock.now = 29.0
        ticker.tick()  # 14 s since the last line: quiet
        clock.now = 31.0
        ticker.tick()
        clock.now = 33.0
    assert log.getvalue().splitlines() == [
        "compiling: started",
        "compiling  (15 s)",
        "compiling  (31 s)",
        "compiling  (33 s): done",
    ]


def test_a_phase_whose_caller_prints_its_own_lines_heartbeats_after_the_callers_last() -> None:
    console, log = log_console()
    clock, ticker = FakeClock(), FakeTicker()
    with phase(console, "rl step", 3, clock=clock, every_s=15.0, ticker=ticker, lines=False) as bar:
        clock.now = 40.0
        ticker.tick()  # the first step compiles: 40 s without a line
        bar.update(1, "reward 0.50")  # the caller printed its step line now
        clock.now = 50.0
        ticker.tick()
        bar.update(2)
        clock.now = 60.0
        bar.update(3)
    assert log.getvalue().splitlines() == [
        "rl step 0/3: started",
        "rl step 0/3  (40 s)",
        "rl step 3/3  (60 s): done",
    ]


def test_a_failed_phase_does_not_say_done() -> None:
    console, log = log_console()
    with contextlib.suppress(RuntimeError), phase(console, "eval episode", 4, ticker=FakeTicker()):
        raise RuntimeError("engine died")
    assert log.getvalue().splitlines() == ["eval episode 0/4: started"]


def test_a_terminal_gets_a_bar_with_the_count_and_no_plain_lines() -> None:
    log = io.StringIO()
    console = Console(file=log, force_terminal=True, width=120, color_system=None)
    with phase(console, "sft step", 10) as bar:
        for step in range(10):
            bar.update(step + 1, "loss 0.100")
    out = log.getvalue()
    assert "sft step" in out and "10/10" in out and "loss 0.100" in out
    assert "started" not in out and "done" not in out
