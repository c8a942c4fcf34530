"""What the rejection sampler's two kernels share: constants, the scaled-logits load, argmax
helpers with torch.argmax's tie rule, and the "last program of the request" protocol.

Each kernel ends with a "last program of the request" step instead of a third launch: every program
of a request publishes its chunk's result (an atomic exchange, so it lands in L2), then bumps the
request's counter (release); the program that sees the count complete (acquire) reduces the chunks,
reading past L1 (``.cg``), and writes the request's output. The stats kernel does the same per row
first, then marks the row in the request's state word (``ROW_BITS``). Counters live in a workspace that
is zero between calls: the program that completes a count sets it back to 0
(``specsplit/kernels/triton_rejection.py``), so no memset runs per call and no state survives a call.
"""

import triton
import triton.language as tl

# Per-request inputs arrive as views into one uploaded buffer (`models/step_upload.py`), at offsets that change
# with the batch. Triton would compile a variant per 16-byte alignment of each pointer, mid-run (a stall of every
# request in flight); these are read a scalar at a time anyway, so neither kernel specialises on their alignment.
UNALIGNED_INPUTS = ["draft_ids_ptr", "cu_num_draft_ptr", "temperature_ptr", "seeds_ptr", "positions_ptr",
                    "threshold_ptr", "q_ids_ptr"]  # fmt: skip
BIG_TOKEN = tl.constexpr(2147483647)
LOG2E = tl.constexpr(1.4426950408889634)
NO_MAX = tl.constexpr(-3.0e38)  # running max before any finite x (logits are far above it)
# What the race kernel does for a request (race_mode): nothing (greedy), the race from p (bonus row or
# padded draft), the race from p without the rejected one-hot draft, or the residual max(p - q, 0).
NO_RACE = tl.constexpr(0)
RACE_P = tl.constexpr(1)
RACE_P_EXCLUDE_DRAFT = tl.constexpr(2)
RACE_RESIDUAL = tl.constexpr(3)
# A request's state is one int64: bit j once its row j is done, bit ROW_BITS + j if that row was rejected. So a
# request has at most ROW_BITS rows (ROW_BITS - 1 drafts).
ROW_BITS = tl.constexpr(32)


@triton.jit
def row_threshold(threshold_ptr, row, HAS_THRESHOLD: tl.constexpr):
    """The row's top-k / top-p logit threshold; -inf when no request filters."""
    threshold = tl.full([], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    return threshold


@triton.jit
def scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature, HAS_THRESHOLD: tl.constexpr):
    """x = logits / T where logits >= threshold, else -inf (also past the vocabulary)."""
    logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    x = logits * inv_temperature
    if HAS_THRESHOLD:
        x = tl.where(logits >= threshold, x, float("-inf"))
    return x


@triton.jit
def lane_argmax(values, offs, best, token):
    """Per-lane running argmax; a later tile replaces a lane's entry only if strictly larger."""
    take = values > best
    return tl.where(take, values, best), tl.where(take, offs, token)


@triton.jit
def first_argmax(best, token):
    """(max, smallest token holding it) over lanes or chunks: torch.argmax's tie rule."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, token, BIG_TOKEN), axis=0)


@triton.jit
def publish(ptr, value, mask=None):
    """A result another program of the request reduces: written at L2 (an atomic exchange), so the
    release of the counter below orders it for the reader, whatever thread stored it. 32-bit values
    travel as int32 bits (the interpreter exchanges integers only)."""
    bits = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    tl.atomic_xchg(bits, value.to(tl.int32, bitcast=True), mask=mask, sem="relaxed")


@triton.jit
def last_of_request(counter_ptr, req, total):
    """Count this program as done (the counter starts at 0 every call); True for the request's last
    program, which may then read what the others published."""
    tl.debug_barrier()  # every thread's writes of this program happen before the release below
    last = tl.atomic_add(counter_ptr + req, 1, sem="acq_rel") == total - 1
    tl.debug_barrier()  # and the reader's loads after the acquire
    return last
