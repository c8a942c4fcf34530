"""benchmarks/iteration_profile.py: the interval arithmetic that splits an iteration's wall time into GPU work of
each process, both at once, and idle time per host phase."""

import json
import types

from benchmarks import iteration_profile as ip


def test_merge_intersect_complement():
    assert ip.merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert ip.intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert ip.complement([(0, 3), (5, 8)], 1, 10) == [(3, 5), (8, 10)]
    assert ip.length(ip.clip([(0, 3), (5, 8)], 2, 6)) == 2


def test_gpu_intervals_are_on_the_wall_clock(tmp_path):
    trace = tmp_path / "t.json"
    events = [
        {"ph": "X", "cat": "kernel", "ts": 10.0, "dur": 2.0},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 11.5, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 100.0},  # host work is not GPU work
    ]
    trace.write_text(json.dumps({"baseTimeNanoseconds": 1_000_000, "traceEvents": events}))
    assert ip.gpu_intervals(trace) == [(1_010_000, 1_012_500)]


def _timing(start, sent, v_received, wait, v_replied, received, end, propose=None):
    v = types.SimpleNamespace(
        received_ns=v_received,
        drafts_wait_ns=wait,
        replied_ns=v_replied,
        propose_sent_ns=0,
        drafter_received_ns=0,
        drafter_replied_ns=0,
        propose_received_ns=0,
    )
    if propose:
        v.propose_sent_ns, v.drafter_received_ns, v.drafter_replied_ns, v.propose_received_ns = propose
    return types.SimpleNamespace(
        schedule_start_ns=start, verify_sent_ns=sent, verify_received_ns=received, post_step_end_ns=end, verifier=v
    )


def test_an_iteration_splits_into_gpu_work_and_idle_per_phase():
    # schedule 0-10, hop 10-20, drafts wait 20-30, verifier 30-70, hop 70-80, post_step 80-100;
    # the Propose: hop 60-65, drafter 65-90, hop 90-95 (overlapping the next iteration's host work).
    it = _timing(0, 10, 20, 10, 70, 80, 100, propose=(60, 65, 90, 95))
    verifier_gpu = [(35, 60)]
    drafter_gpu = [(50, 85)]
    (row,) = ip.services_rows([it], verifier_gpu, drafter_gpu)
    ms = {k: round(v * 1e6) for k, v in row.items()}
    assert ms["iteration"] == 100
    assert ms["gpu_verifier"] == 25 and ms["gpu_drafter"] == 35 and ms["gpu_both"] == 10
    assert ms["gpu_idle"] == 100 - 50  # busy 35..85
    assert ms["idle: drafter"] == 5  # 85-90
    assert ms["idle: hop d->v"] == 5  # 90-95
    assert ms["idle: verifier: drafts wait"] == 10
    assert ms["idle: verifier"] == 5  # 30-35
    assert ms["idle: coordinator: schedule"] == 10 and ms["idle: hop c->v"] == 10
    assert ms["idle: coordinator: post_step"] == 5  # 95-100
    assert sum(v for k, v in ms.items() if k.startswith("idle: ")) == ms["gpu_idle"]
