"""Early exit: no output depends on a row past a request's first rejection, and the stats kernel's programs
for such rows skip their read once the rejection is known. The interpreter runs programs one at a time, its
outermost loop over grid axis 0 ((request, chunk), chunk fastest), then rows: with one chunk per row every later
row starts after the rejection."""

import dataclasses

import pytest

from specsplit.kernels import triton_rejection
from specsplit.kernels.rng import GROUP_SIZE
from specsplit.kernels.triton_rejection_launch import Launch

MODES = ["one_hot", "dense", "sparse"]
UNWRITTEN = 12345.0  # what the stats scratch holds before the kernel runs


@pytest.fixture
def stats_scratch(monkeypatch):
    """The per-piece maxima each call's stats kernel writes, [num_logits, num_pieces] per call, filled with
    UNWRITTEN before the kernel runs."""
    calls = []
    scratch = triton_rejection._scratch

    def marked(num_logits, num_reqs, num_stats_pieces, num_race_pieces, device):
        buffers = scratch(num_logits, num_reqs, num_stats_pieces, num_race_pieces, device)
        buffers[0].fill_(UNWRITTEN)
        calls.append(buffers[0][: num_logits * num_stats_pieces].view(num_logits, num_stats_pieces))
        return buffers

    monkeypatch.setattr(triton_rejection, "_scratch", marked)
    return calls


def logits_rows(batch) -> list[range]:
    cu = batch.cu_num_draft.tolist()
    return [range(cu[r] + r, cu[r + 1] + r + 1) for r in range(len(cu) - 1)]


@pytest.mark.parametrize("mode", MODES)
def test_rows_past_the_first_rejection_are_not_read(batch_factory, same_output, stats_scratch, mode):
    batch = batch_factory(41, [5, 4, 3, 5, 2, 0, 5], 300, hit_rate=0.5)
    expected = batch.sample(mode, "reference")
    out = batch.sample(mode, "triton")  # one chunk per row (INTERPRETER_LAUNCH)
    same_output(out, expected)
    (block_max,) = stats_scratch
    skipped = 0
    for req, rows in enumerate(logits_rows(batch)):
        stop = rows[0] + int(out.num_sampled[req]) - 1
        for row in rows:
            read = bool((block_max[row] != UNWRITTEN).all())
            assert read == (row <= stop), f"request {req}, logits row {row}, stop row {stop}"
            skipped += row > stop
    assert skipped >= 5  # the batch does exercise the early exit


@pytest.mark.parametrize("mode", MODES)
def test_rows_cut_short_by_a_rejection_change_nothing(batch_factory, same_output, stats_scratch, mode):
    """Two chunks per row: the interpreter runs a request's first chunk of every row, then its second chunks, so
    a later row's second chunk is skipped after its first was read: rows with half their statistics."""
    batch = batch_factory(43, [4, 3, 4, 1, 4], 100, hit_rate=0.5)
    out = batch.sample(mode, "triton", launch=Launch(64, 64, 4, 64, 64, 4))
    same_output(out, batch.sample(mode, "reference"))
    (block_max,) = stats_scratch
    cut_short = 0
    for req, rows in enumerate(logits_rows(batch)):
        stop = rows[0] + int(out.num_sampled[req]) - 1
        for row in rows:
            first, second = bool(block_max[row, 0] != UNWRITTEN), bool(block_max[row, 1] != UNWRITTEN)
            assert (first, second) == (True, row <= stop), f"request {req}, logits row {row}, stop row {stop}"
            cut_short += row > stop
    assert cut_short >= 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_garbage_past_the_first_rejection_changes_nothing(batch_factory, same_output, mode, backend):
    batch = batch_factory(47, [5, 3, 5, 4, 5], 2 * GROUP_SIZE + 77, hit_rate=0.5)
    out = batch.sample(mode, backend)
    garbage = batch.logits.clone()
    for req, rows in enumerate(logits_rows(batch)):
        past = rows[0] + int(out.num_sampled[req])
        garbage[past : rows[-1] + 1] = float("nan")
    assert garbage.isnan().any()
    same_output(dataclasses.replace(batch, logits=garbage).sample(mode, backend), out)


def test_every_call_leaves_the_counters_at_zero(batch_factory, same_output):
    """The counters live in a per-device workspace with no memset per call: each call must leave it at 0,
    whatever the batch (rejections, early exits, dense residual races, greedy rows, the race in the stats
    kernel, several chunks per row), or a later call would start from stale counts."""
    batch = batch_factory(53, [3, 0, 5, 2, 4, 1], 2 * GROUP_SIZE + 5, hit_rate=0.5)
    launches = [None, Launch(1024, 512, 4, 1024, 512, 4), Launch(1024, 512, 4, 1024, 512, 4, race_in_stats=True)]
    first = {}
    for _ in range(2):
        for launch in launches:
            for mode in MODES:
                out = batch.sample(mode, "triton", launch=launch)
                workspaces = triton_rejection._WORKSPACES[("cpu", None)]
                assert all(int(w.count_nonzero()) == 0 for w in workspaces), (launch, mode)
                if (launch, mode) in first:
                    same_output(out, first[launch, mode])
                first[launch, mode] = out


@pytest.mark.parametrize("launch", [None, Launch(64, 64, 4, 64, 64, 4, race_in_stats=True)])
def test_requests_of_up_to_31_drafts(batch_factory, same_output, launch):
    """A request's rows are bits of one state word: 32 rows, all reached (greedy drafts that are the argmax
    reach the bonus row), beside shorter requests; one more draft is refused."""
    batch = batch_factory(59, [31, 30, 3, 2], 100, greedy=[True, True, False, False], hit_rate=0.5)
    drafts, cu = batch.drafts.clone(), batch.cu_num_draft.tolist()
    for req, rows in enumerate(logits_rows(batch)[:2]):
        drafts[cu[req] : cu[req + 1]] = batch.logits[rows[:-1]].argmax(-1)
    batch = dataclasses.replace(batch, drafts=drafts)
    for mode in MODES:
        out = batch.sample(mode, "triton", launch=launch)
        same_output(out, batch.sample(mode, "reference"))
        assert out.num_sampled[:2].tolist() == [32, 31]
        assert all(int(w.count_nonzero()) == 0 for w in triton_rejection._WORKSPACES[("cpu", None)])
    too_long = batch_factory(61, [2, 32], 100)
    with pytest.raises(ValueError, match="at most 31 drafts"):
        too_long.sample("one_hot", "triton")
