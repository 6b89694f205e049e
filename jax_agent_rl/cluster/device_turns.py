"""Turns on the devices for threads that share them.

A program that spans several devices runs a part on each, and the parts of one collective wait
for each other. Programs launched from two threads with no data between them may run their
parts in any order on the CPU runtime's few threads: each of two programs can hold a thread
waiting for a peer part that has no thread left to run on, and XLA aborts the process after
40 s (or, seen here, training silently went wrong).

The synchronous trainer never launches from two threads at once (its rollouts and its updates
take turns), but the asynchronous one updates while the embedded engine's thread decodes. So
both take `TURN` around their device programs, and hold it until those programs are done: the
engine around each round of admissions and decoding (milliseconds), the learner around each
update (the engine waits for it, while the agent loops and the tools go on). Backends in
processes of their own (vLLM, JetStream) have devices of their own.
"""

from __future__ import annotations

import threading

TURN = threading.RLock()
