"""benchmarks/host_path.py drives the verifier's worker and the drafter's runner and servicer functions with their
GPU work stubbed; it breaks whenever they change shape (and checks that its iterations take the early plan and, on
the co-located path, the device hand-off), so a tiny run of both paths is made here."""

from benchmarks import host_path
from specsplit.models.loader import load_mtp, load_target


def test_host_path_times_every_phase_of_both_paths():
    models = load_target(host_path.CHECKPOINT), load_mtp(host_path.CHECKPOINT)
    names = [f"v:{p}" for p in (*host_path.VERIFIER_PHASES, host_path.OFF_PATH)]
    names += [f"d:{p}" for p in host_path.DRAFTER_PHASES]
    for hand_off in (True, False):
        times = host_path.run(3, 2, 20, 2, hand_off, models)
        assert sorted(times) == sorted(names)
        assert all(t > 0 for t in times.values()), times
    assert "compute_logits" not in models[1].__dict__  # the stubs are gone after the run
