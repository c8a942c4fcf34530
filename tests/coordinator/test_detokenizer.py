"""Incremental detokenization: same text as a full decode, UTF-8 held back, stop strings cut."""

from coordinator.detokenizer import IncrementalDetokenizer


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


def test_stop_string_is_cut_and_never_streamed_partially():
    deltas, d = stream(b"abc STOP def", stop=("STOP",))
    assert d.stopped and "".join(deltas) == "abc "
    assert not any("S" in x for x in deltas)


def test_stop_string_spanning_tokens_of_several_steps():
    deltas, d = stream(b"x = 1\n\n\ny = 2", stop=("\n\n",), chunk=3)
    assert "".join(deltas) == "x = 1" and d.stopped
