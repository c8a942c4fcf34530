"""The verifier's grammar masks (structured output): row r of a constrained request allows what the grammar allows
after its output and drafts[:r]; rows after a draft the grammar refuses allow everything; the matcher follows the
output step after step, starts afresh where the output went another way, and the drafts leave no trace; the masks
reach the logits as -inf wherever a token is not allowed."""

import json

import llguidance
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from specsplit.client.errors import InvalidArgument
from specsplit.runtime.grammar import DraftMasks, Grammars, draft_grammar
from specsplit.verifier.logits_processors import LogitsOptions, LogitsPlan, RequestRows, apply
from tests.e2e.test_demo_model import DEMO

GRAMMAR = llguidance.LLMatcher.grammar_from_regex("(hello|world) [0-9]+")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO)


def allowed_ids(row: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist())


def drafter_row(grammars: Grammars, rid: str, grammar: str, output: list[int], drafts: list[int]) -> np.ndarray:
    """The drafter's mask after the output and `drafts`, filled step after step as a Propose fills it (one draft more
    each step, `DraftMasks`), the drafts rolled back after."""
    masks = DraftMasks(grammars, {0: (rid, grammar, output, 0)})
    out = np.zeros((1, grammars.words), dtype=np.int32)
    for j in range(len(drafts) + 1):
        masks.fill([(0, 0, drafts[:j])], out)
    masks.close()
    return out[0]


def test_each_row_allows_what_follows_the_output_and_the_drafts_before_it(tok):
    grammars = Grammars(DEMO)
    hello, num = tok.encode("hello 42", add_special_tokens=False)
    masks = grammars.masks("r", GRAMMAR, [], [hello, num])
    assert hello in allowed_ids(masks[0]) and num not in allowed_ids(masks[0])
    assert num in allowed_ids(masks[1]) and hello not in allowed_ids(masks[1])
    assert tok.eos_token_id in allowed_ids(masks[2])  # "hello 42" is complete: EOS (or more digits)
    # The drafts were rolled back: the same output gives the same masks, and a step later the output takes them.
    assert np.array_equal(grammars.masks("r", GRAMMAR, [], [hello, num]), masks)
    assert np.array_equal(grammars.masks("r", GRAMMAR, [hello], [num]), masks[1:])


def test_rows_after_a_refused_draft_allow_everything(tok):
    hello = tok.encode("hello", add_special_tokens=False)[0]
    masks = Grammars(DEMO).masks("r", GRAMMAR, [hello], [hello, hello])
    assert hello not in allowed_ids(masks[0])
    assert len(allowed_ids(masks[1])) == len(allowed_ids(masks[2])) == masks.shape[1] * 32


def test_rows_after_an_eos_draft_are_masked_as_the_eos_row(tok):
    """Under ignore_eos a request goes on after an EOS; target-only decoding masks what follows it as the EOS was (the
    matcher follows the output up to its first EOS), so the verifier's rows after an EOS draft do too, and so does the
    drafter's next mask."""
    grammars = Grammars(DEMO)
    hello, num = tok.encode("hello 42", add_special_tokens=False)
    eos = tok.eos_token_id
    masks = grammars.masks("r", GRAMMAR, [hello], [num, eos, num, num])
    assert eos in allowed_ids(masks[1]) and hello not in allowed_ids(masks[1])
    for row in masks[2:]:
        assert np.array_equal(row, masks[1])
    assert np.array_equal(drafter_row(grammars, "r", GRAMMAR, [hello], [num, eos, hello]), masks[1])


def test_an_output_past_its_eos_is_followed_up_to_the_eos_step_after_step(tok):
    """Under ignore_eos the output goes on after its EOS with tokens the grammar would refuse: the matcher, which looks
    only at the tokens past what it consumed, stops at the EOS, and the rows stay those of the EOS's state."""
    grammars = Grammars(DEMO)
    hello, num = tok.encode("hello 42", add_special_tokens=False)
    eos = tok.eos_token_id
    at_eos = grammars.masks("r", GRAMMAR, [hello, num], [])
    for output in ([hello, num, eos], [hello, num, eos, hello], [hello, num, eos, hello, hello, num]):
        assert np.array_equal(grammars.masks("r", GRAMMAR, output, []), at_eos)
        assert np.array_equal(drafter_row(grammars, "r", GRAMMAR, output, []), at_eos[0])
    assert np.array_equal(Grammars(DEMO).masks("x", GRAMMAR, [hello, num, eos, hello], []), at_eos)


def test_an_output_that_went_another_way_starts_a_fresh_matcher_and_one_off_the_grammar_is_refused(tok):
    grammars = Grammars(DEMO)
    hello, world = tok.encode("hello", add_special_tokens=False), tok.encode("world", add_special_tokens=False)
    after_hello = grammars.masks("r", GRAMMAR, hello, [])
    after_world = grammars.masks("r", GRAMMAR, world, [])  # a re-prefill that sampled otherwise
    assert np.array_equal(after_world, Grammars(DEMO).masks("x", GRAMMAR, world, []))
    assert np.array_equal(after_hello, after_world)  # both wait for " <digits>"
    hello = hello[0]
    with pytest.raises(InvalidArgument, match="does not follow its grammar"):
        grammars.masks("r", GRAMMAR, [hello, hello], [])


def test_masks_become_minus_infinity_on_the_logits(tok):
    hello, num = tok.encode("hello 42", add_special_tokens=False)
    masks = Grammars(DEMO).masks("r", GRAMMAR, [], [hello])
    vocab = 4100  # a model vocabulary padded past the tokenizer's 4,096 ids
    logits = torch.zeros(3, vocab)
    rows = RequestRows(0, 1, [hello], [], 0, 0, LogitsOptions(grammar=GRAMMAR), allowed=masks)
    apply(logits, LogitsPlan([rows]))
    assert torch.equal(logits[0], torch.zeros(vocab))  # another request's row
    for r in (0, 1):
        finite = set(torch.nonzero(logits[1 + r] == 0).flatten().tolist())
        assert finite == allowed_ids(masks[r])
        assert (logits[1 + r, 4096:] == float("-inf")).all()


def test_the_drafters_masks_follow_its_drafts_step_after_step_and_leave_no_trace(tok):
    """A Propose's masks (`DraftMasks`): each step's row of a request is the verifier's row after the drafts so far,
    each draft consumed once as it comes; a request whose output its grammar refuses gets an error and rows allowing
    everything, a draft the grammar refuses leaves its request unmasked from then on, and the others are unaffected;
    `close` rolls every draft back."""
    grammars = Grammars(DEMO)
    hello, num = tok.encode("hello 42", add_special_tokens=False)
    rows = grammars.masks("r0", GRAMMAR, [], [hello, num])
    everything = grammars.words * 32
    masks = DraftMasks(
        grammars, {0: ("r0", GRAMMAR, [], 0), 1: ("r1", GRAMMAR, [], 0), 2: ("bad", GRAMMAR, [num, num], 0)}
    )
    assert list(masks.errors) == [2] and isinstance(masks.errors[2], InvalidArgument)
    out = np.zeros((3, grammars.words), dtype=np.int32)
    refused = [hello, hello]  # the second is not what the grammar allows after "hello"
    for step in range(3):
        masks.fill([(0, 0, [hello, num][:step]), (1, 1, refused[:step]), (2, 2, [])], out)
        assert np.array_equal(out[0], rows[step]), step
        assert len(allowed_ids(out[1])) == (everything if step == 2 else len(allowed_ids(rows[step])))
        assert len(allowed_ids(out[2])) == everything
    masks.close()
    assert np.array_equal(grammars.masks("r0", GRAMMAR, [], []), rows[:1])  # the drafts were rolled back
    assert np.array_equal(grammars.masks("r1", GRAMMAR, [], []), rows[:1])


def test_the_drafter_follows_the_output_past_its_offset_and_asks_for_the_whole_of_it_where_it_lacks_it(tok):
    """A Propose carries a constrained request's output past what its earlier Proposes carried (`output_offset`): the
    drafter's matcher takes the new tokens alone, and its masks are those of the whole output; a tail that overlaps
    what the matcher followed (a device hand-off's tokens, read from the device the time before) is compared, not
    consumed twice. A matcher that did not follow the output up to the offset (a restarted drafter, another replica,
    an output that went another way) is not guessed at: the request allows everything and is `wanted`, and a whole
    output (offset 0) then brings it back."""
    grammars = Grammars(DEMO)
    hello, space_num = tok.encode("hello 42", add_special_tokens=False)
    digit = tok.encode("7", add_special_tokens=False)[0]
    output = [hello, space_num, digit, digit]
    expected = [Grammars(DEMO).masks("x", GRAMMAR, output[:n], [])[0] for n in range(len(output) + 1)]
    everything = grammars.words * 32

    def row(tail: list[int], offset: int, rid: str = "r") -> tuple[np.ndarray, list[int]]:
        masks = DraftMasks(grammars, {0: (rid, GRAMMAR, tail, offset)})
        out = np.zeros((1, grammars.words), dtype=np.int32)
        masks.fill([(0, 0, [])], out)
        masks.close()
        return out[0], masks.wanted

    assert np.array_equal(row(output[:1], 0)[0], expected[1])  # the first Propose: the whole output
    assert np.array_equal(row(output[1:3], 1)[0], expected[3])  # then what came after
    assert np.array_equal(row(output[1:4], 1)[0], expected[4])  # overlapping what it followed: compared, not redone
    assert grammars._matchers["r"].followed == output
    missing, wanted = row(output[4:], 3, rid="new")  # a drafter that never saw this request
    assert wanted == [0] and len(allowed_ids(missing)) == everything
    other, wanted = row([hello, hello], 3)  # followed otherwise past the offset: another output
    assert wanted == [0] and len(allowed_ids(other)) == everything
    assert np.array_equal(row(output, 0, rid="new")[0], expected[4]) and not row(output, 0, rid="new")[1]


def test_the_drafters_masks_follow_a_hand_offs_step_after_what_the_propose_carried(tok):
    """A device hand-off's Propose carries the output before the step; its masks follow that first (while the device
    finishes the step) and then the step's tokens (`follow`): the masks equal those of the whole output carried, the
    next Propose's tail overlapping them is compared, not consumed again, and step tokens the grammar refuses leave
    that request allowing everything (an error), the others masked."""
    grammars = Grammars(DEMO)
    hello, space_num = tok.encode("hello 42", add_special_tokens=False)
    digit = tok.encode("7", add_special_tokens=False)[0]
    output = [hello, space_num, digit]
    expected = [Grammars(DEMO).masks("x", GRAMMAR, output[:n], [])[0] for n in range(len(output) + 1)]
    everything = grammars.words * 32
    out = np.zeros((2, grammars.words), dtype=np.int32)

    masks = DraftMasks(grammars, {0: ("r", GRAMMAR, output[:1], 0), 1: ("s", GRAMMAR, [], 0)})
    masks.follow({0: output[1:3], 1: [digit]})  # "s" cannot start with a digit
    masks.fill([(0, 0, []), (1, 1, [])], out)
    masks.close()
    assert np.array_equal(out[0], expected[3]) and grammars._matchers["r"].followed == output
    assert list(masks.errors) == [1] and len(allowed_ids(out[1])) == everything

    masks = DraftMasks(grammars, {0: ("r", GRAMMAR, output[1:], 1)})  # the next Propose: the step carried again
    masks.follow({0: [digit]})
    masks.fill([(0, 0, [])], out)
    masks.close()
    assert not masks.wanted and not masks.errors and grammars._matchers["r"].followed == [*output, digit]
    assert np.array_equal(out[0], Grammars(DEMO).masks("x", GRAMMAR, [*output, digit], [])[0])


def test_the_verifiers_matcher_reads_only_the_output_past_what_earlier_steps_gave_it(tok):
    """The verifier gives each step the whole output (its history's view, an int64 array) and how much of it earlier
    steps gave too (`kept`: up to num_computed_tokens): the matcher reads only what comes after; where the history was
    cut back below what it followed (a re-prefill) and went another way there, a fresh matcher follows the whole
    output. The masks are those of a matcher given the whole output each time."""
    grammars = Grammars(DEMO)
    hello, space_num = tok.encode("hello 42", add_special_tokens=False)
    world = tok.encode("world 42", add_special_tokens=False)
    digit = tok.encode("7", add_special_tokens=False)[0]

    def check(output: list[int], kept: int) -> None:
        got = grammars.batch_masks([("r", GRAMMAR, np.array(output, dtype=np.int64), [digit])], [kept])[0]
        assert np.array_equal(got, Grammars(DEMO).masks("x", GRAMMAR, output, [digit])), (output, kept)

    for output, kept in (([hello], 0), ([hello, space_num], 1), ([hello, space_num, digit], 2)):
        check(output, kept)
    followed = grammars._matchers["r"]
    assert followed.followed == [hello, space_num, digit]
    check(world, 0)  # cut back to nothing and gone another way: a fresh matcher
    assert grammars._matchers["r"] is not followed and grammars._matchers["r"].followed == world
    redone = grammars._matchers["r"]
    check([*world, digit], 1)  # cut back within what it followed, the same tokens again: the same matcher
    assert grammars._matchers["r"] is redone and redone.followed == [*world, digit]


def test_a_batchs_new_matchers_made_together_mask_as_ones_made_alone(tok):
    """New requests' matchers are built on threads together (`_make_matchers`): their masks equal those of matchers
    made one request at a time, for two grammars in one batch, and a request given another grammar gets a new one."""
    other = llguidance.LLMatcher.grammar_from_regex("[0-9]+ (hello|world)")
    ids = tok.encode("hello 42", add_special_tokens=False)
    digits = tok.encode("42 ", add_special_tokens=False)
    jobs = [(f"r{i}", GRAMMAR if i % 2 else other, [], (ids if i % 2 else digits)[: i % 3]) for i in range(6)]
    together = Grammars(DEMO)
    masks = together.batch_masks(jobs)
    assert len(together._matchers) == 6 and together._builders is not None  # made on the threads
    alone = Grammars(DEMO)
    for job, got in zip(jobs, masks):
        assert np.array_equal(got, alone.batch_masks([job])[0]), job
    regrammared = [(rid, other if g == GRAMMAR else GRAMMAR, [], []) for rid, g, _, _ in jobs[:2]]
    masks = DraftMasks(together, {j: (rid, g, [], 0) for j, (rid, g, _, _) in enumerate(regrammared)})
    assert masks.errors == {}
    words = np.zeros((2, together.words), dtype=np.int32)
    masks.fill([(j, j, []) for j in range(2)], words)
    for (rid, g, _, _), row in zip(regrammared, words):
        assert together._matchers[rid].grammar == g
        assert np.array_equal(row, alone.masks("fresh" + rid, g, [], [])[0])


def test_a_finished_requests_matcher_serves_the_next_request_of_its_grammar_as_a_new_one_would(tok):
    """`free` keeps the matcher, reset, for the next request of the same grammar (its lexer states stay built): that
    request's masks, step after step, equal a new matcher's; a request of another grammar does not get it; a matcher
    of a request whose output broke its grammar is not kept."""
    hello, num = tok.encode("hello 42", add_special_tokens=False)
    grammars = Grammars(DEMO)
    grammars.masks("done", GRAMMAR, [hello], [num])
    finished = grammars._matchers["done"].matcher
    grammars.free(["done"])
    other = llguidance.LLMatcher.grammar_from_regex("[0-9]+ (hello|world)")
    grammars.masks("other", other, [], [])
    assert grammars._matchers["other"].matcher is not finished
    fresh = Grammars(DEMO)
    for output, drafts in [([], [hello, num]), ([hello], [num]), ([hello, num], [])]:
        assert np.array_equal(
            grammars.masks("next", GRAMMAR, output, drafts), fresh.masks("r", GRAMMAR, output, drafts)
        )
        assert grammars._matchers["next"].matcher is finished
    with pytest.raises(InvalidArgument, match="does not follow its grammar"):
        grammars.masks("next", GRAMMAR, [hello, num, hello], [])
    grammars.free(["next", "other"])
    assert grammars._take_idle(GRAMMAR) is None  # "next" was dropped, not kept


def test_kept_matchers_are_bounded_the_grammar_finished_longest_ago_dropped_first(tok, monkeypatch):
    monkeypatch.setattr("specsplit.runtime.grammar.IDLE_MATCHERS", 3)
    grammars = Grammars(DEMO)
    old, new = GRAMMAR, llguidance.LLMatcher.grammar_from_regex("[0-9]+ (hello|world)")
    jobs = [(f"old{i}", old, [], []) for i in range(2)] + [(f"new{i}", new, [], []) for i in range(2)]
    grammars.batch_masks(jobs)
    grammars.free(["old0", "old1", "new0", "new1"])  # four kept, one over: one of `old`'s dropped
    assert grammars._num_idle == 3 and len(grammars._idle[old]) == 1 and len(grammars._idle[new]) == 2
    grammars.batch_masks([("a", old, [], []), ("b", old, [], []), ("c", new, [], [])])  # old's one, then a new one
    assert grammars._num_idle == 1 and old not in grammars._idle
    grammars.clear()  # a new coordinator: every request's matcher kept as a finished one's
    assert grammars._num_idle == 3 and not grammars._matchers


def test_the_drafter_masks_loose_string_bounds_away_and_keeps_tight_ones(tok):
    """The drafter's grammar (`draft_grammar`) leaves out a JSON schema's loose string length bounds (a lexer state per
    length, each first mask of one a walk of the vocabulary): at a string's 40th character the verifier allows only its
    end, the drafter more; a tight bound is masked by both. Property names are kept whatever they are called, and
    grammars other than JSON schemas are left as they are."""
    schema = {
        "type": "object",
        "properties": {
            "maxLength": {"type": "string", "maxLength": 40},  # a property of that name, whose bound is loose
            "tags": {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 4}]}},
        },
        "$defs": {"long": {"type": "string", "minLength": 32}},
        "required": ["maxLength", "tags"],
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    relaxed = json.loads(draft_grammar(grammar))["grammars"][0]["json_schema"]
    assert relaxed["properties"]["maxLength"] == {"type": "string"}
    assert relaxed["properties"]["tags"]["items"]["anyOf"][0] == {"type": "string", "minLength": 2, "maxLength": 4}
    assert relaxed["$defs"]["long"] == {"type": "string"}
    assert draft_grammar(GRAMMAR) is GRAMMAR  # a regex: nothing to relax

    grammars = Grammars(DEMO)
    (letter,) = tok.encode("a", add_special_tokens=False)
    for field, prefix in (("maxLength", '{"maxLength":"' + "a" * 40), ("tags", '{"maxLength":"a","tags":["aaaa')):
        output = tok.encode(prefix, add_special_tokens=False)
        verifier = allowed_ids(grammars.masks(f"v-{field}", grammar, output, [])[0])
        drafter = allowed_ids(drafter_row(Grammars(DEMO), f"d-{field}", grammar, output, []))
        assert verifier and letter not in verifier  # at the bound: the string ends
        assert (letter in drafter) == (field == "maxLength")  # the loose bound left out, the tight one kept
