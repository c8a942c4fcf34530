"""SlowStepWatch: a step over the threshold is logged while it runs, with the stack of the thread running it,
then once more when it ends, and counted; a quick step, and every step with the watch off, leave no trace."""

import logging
import threading
import time

import pytest

from specsplit.runtime.slow_steps import SlowStepWatch


def _stuck_in_a_compile(seconds: float) -> None:
    time.sleep(seconds)


def test_a_step_over_the_threshold_is_logged_with_its_stack_while_it_runs(caplog):
    watch = SlowStepWatch("verifier", threshold_s=0.05)
    caplog.set_level(logging.WARNING, logger="specsplit.runtime.slow_steps")
    try:
        with watch.watch("step"):
            _stuck_in_a_compile(0.4)
            running = [r.getMessage() for r in caplog.records]  # logged before the step ended
    finally:
        watch.close()
    assert watch.num_slow == 1
    assert len(running) == 1
    assert "verifier: a step has been running for" in running[0] and "over --slow-step-s 0.05" in running[0]
    assert "_stuck_in_a_compile" in running[0] and "time.sleep" in running[0]  # the step thread's stack
    assert "the slow step finished after" in caplog.records[-1].getMessage()


def test_quick_steps_and_a_watch_that_is_off_log_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="specsplit.runtime.slow_steps")
    quick = SlowStepWatch("drafter", threshold_s=0.5)
    off = SlowStepWatch("drafter", threshold_s=0)
    try:
        for _ in range(20):
            with quick.watch("propose"):
                pass
        with off.watch("propose"):
            _stuck_in_a_compile(0.1)
        time.sleep(0.2)  # the watcher polls meanwhile
    finally:
        quick.close()
        off.close()
    assert quick.num_slow == off.num_slow == 0
    assert not caplog.records
    assert off._thread is None  # off: not even the watcher thread


def test_each_of_two_concurrent_slow_steps_is_reported_with_its_own_thread(caplog):
    watch = SlowStepWatch("drafter", threshold_s=0.05)
    caplog.set_level(logging.WARNING, logger="specsplit.runtime.slow_steps")

    def connection(what: str) -> None:
        with watch.watch(what):
            _stuck_in_a_compile(0.3)

    threads = [threading.Thread(target=connection, args=(w,)) for w in ("propose-a", "propose-b")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    finally:
        watch.close()
    running = [r.getMessage() for r in caplog.records if "has been running" in r.getMessage()]
    assert watch.num_slow == 2 and len(running) == 2
    assert {m.split(" has been")[0] for m in running} == {"drafter: a propose-a", "drafter: a propose-b"}
    assert all("connection" in m and "_stuck_in_a_compile" in m for m in running)


def test_a_negative_threshold_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        SlowStepWatch("verifier", threshold_s=-1)
