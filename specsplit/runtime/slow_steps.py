"""Slow-step watch: a model step that runs longer than a threshold is logged, while it still runs, with the
Python stack of the thread running it, and counted (metric ``specsplit.slow_steps``, labels ``role`` and
``step``). The verifier watches its steps (forward + sampling), the drafter its Proposes; both take
``--slow-step-s`` (0: off).

Why: one slow step stalls every request in flight. Such stalls (cuDNN building an attention plan per new shape,
Triton compiling a kernel variant, a per-request attention loop; docs/performance.md, "Decode step and kernels") are
rare, depend on the traffic, and look like a slow GPU from the outside; the stack of the stuck step says which call
it is. The frames below Python (a CUDA library, a compiler) need a native profiler, for example
``py-spy dump --native --pid PID`` while the step runs (py-spy is not a dependency).

One daemon thread per watch wakes a few times per threshold; a step that stays under it costs two dict
operations under a lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

from opentelemetry import metrics

log = logging.getLogger(__name__)
meter = metrics.get_meter("specsplit")
slow_steps = meter.create_counter("specsplit.slow_steps", description="model steps over --slow-step-s")

DEFAULT_SLOW_STEP_S = 1.0


@dataclass
class _Step:
    what: str
    thread_id: int
    start: float
    reported: bool = False


class SlowStepWatch:
    def __init__(self, role: str, threshold_s: float = DEFAULT_SLOW_STEP_S) -> None:
        if threshold_s < 0:
            raise ValueError(f"--slow-step-s must be >= 0 (0: off), got {threshold_s}")
        self.role = role
        self.threshold_s = threshold_s
        self.num_slow = 0  # steps reported so far
        self._poll_s = min(max(threshold_s / 4, 0.005), 0.25)
        self._active: dict[int, _Step] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Watches the block as one step called `what` (on the calling thread)."""
        if self.threshold_s == 0:
            yield
            return
        self._start()
        token = next(self._tokens)
        step = _Step(what, threading.get_ident(), time.monotonic())
        with self._lock:
            self._active[token] = step
        try:
            yield
        finally:
            with self._lock:
                del self._active[token]
            if step.reported:
                log.warning("%s: the slow %s finished after %.2f s", self.role, what, time.monotonic() - step.start)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"{self.role}-slow-steps", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._active.values() if not s.reported and now - s.start >= self.threshold_s]
                for step in late:
                    step.reported = True
            for step in late:
                self._report(step, now)

    def _report(self, step: _Step, now: float) -> None:
        frame = sys._current_frames().get(step.thread_id)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the thread has ended)\n"
        self.num_slow += 1
        slow_steps.add(1, {"role": self.role, "step": step.what})
        log.warning(
            "%s: a %s has been running for %.2f s (over --slow-step-s %g); its thread's stack, innermost last:\n%s",
            self.role,
            step.what,
            now - step.start,
            self.threshold_s,
            stack.rstrip("\n"),
        )
