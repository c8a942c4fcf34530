"""Incremental detokenization: same text as a full decode, UTF-8 held back, stop strings cut."""

from specsplit.coordinator.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """id i < 256 is byte i; decode joins bytes as UTF-8 (invalid tails become U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text_bytes: bytes, stop=(), chunk=1):
    d = IncrementalDetokenizer(ByteTokenizer(), list(b"prompt "), stop)
    out = []
    ids = list(text_bytes)
    for i in range(0, len(ids), chunk):
        out.append(d.add_tokens(ids[i : i + chunk]))
        if d.stopped:
            break
    out.append(d.flush())
    return out, d


def test_streamed_text_equals_full_decode_and_holds_back_partial_utf8():
    text = "héllo wörld — 你好"
    deltas, d = stream(text.encode())
    assert "".join(deltas) == text == d.text
    assert all("\ufffd" not in x for x in deltas)


def test_an_output_that_ends_inside_a_utf8_sequence_keeps_its_bytes_as_a_whole_decode_does():
    """The last token leaves "你" one byte short: the held-back bytes come out at the end, as U+FFFD, as the
    tokenizer's own decode of the whole output gives them, never dropped."""
    data = "ok 你".encode()[:-1]
    deltas, d = stream(data)
    assert "".join(deltas) == d.text == ByteTokenizer().decode(list(data)) == "ok \ufffd"
    assert all("\ufffd" not in x for x in deltas[:-1])  # only the final flush carries it


def test_stop_string_is_cut_and_never_streamed_partially():
    deltas, d = stream(b"abc STOP def", stop=("STOP",))
    assert d.stopped and "".join(deltas) == "abc "
    assert not any("S" in x for x in deltas)


def test_stop_string_spanning_tokens_of_several_steps():
    deltas, d = stream(b"x = 1\n\n\ny = 2", stop=("\n\n",), chunk=3)
    assert "".join(deltas) == "x = 1" and d.stopped


def test_fast_decode_of_the_demo_tokenizer_equals_its_transformers_decode():
    from pathlib import Path

    from transformers import AutoTokenizer

    from specsplit.coordinator.detokenizer import fast_decode

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "checkpoints" / "demo")
    ids = tokenizer.encode("def f(x):\n    return x  # héllo 你好 ,  .\n") + [tokenizer.eos_token_id, 5, 300, 1023]
    decode = fast_decode(tokenizer)
    assert decode is not None and decode.__code__ is not fast_decode(ByteTokenizer()).__code__
    for end in range(1, len(ids) + 1):
        for start in range(0, end, 3):
            assert decode(ids[start:end]) == tokenizer.decode(ids[start:end], skip_special_tokens=True)
