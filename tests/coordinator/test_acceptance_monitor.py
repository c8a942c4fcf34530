"""The acceptance-collapse warning fires once per collapse and re-arms on recovery."""

import logging

from specsplit.coordinator.acceptance import AcceptanceMonitor


def test_warns_once_when_acceptance_collapses_and_rearms(caplog):
    m = AcceptanceMonitor(window=30, threshold=0.2)
    caplog.set_level(logging.WARNING)
    assert not any(m.record(3, 2) for _ in range(20))  # healthy: 0.67
    fired = [m.record(3, 0) for _ in range(20)]  # collapse to 0
    assert fired.count(True) == 1
    assert "draft acceptance collapsed" in caplog.text
    assert not any(m.record(3, 3) for _ in range(20))  # recovers, re-arms
    assert [m.record(3, 0) for _ in range(20)].count(True) == 1


def test_no_verdict_before_a_full_window_or_without_drafts():
    m = AcceptanceMonitor(window=100, threshold=0.5)
    assert not m.record(3, 0) and m.rate is None
    assert not m.record(0, 0)
