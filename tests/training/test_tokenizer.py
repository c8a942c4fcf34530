"""The tokenizer builder: byte-level BPE that AutoTokenizer loads and that round-trips code exactly."""

from transformers import AutoTokenizer

from specsplit.training.tokenizer import EOS_ID, PAD_ID, save_tokenizer, train_tokenizer

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nprint(os.path.join('a', 'b'))  # é, 漢字\n",
] * 20


def test_saved_tokenizer_loads_with_autotokenizer_and_round_trips(tmp_path):
    save_tokenizer(train_tokenizer(CODE, vocab_size=300), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS_ID, EOS_ID, PAD_ID)
    text = "def f(x):\n\tif x:  # \u00e9\n        return b'\\x00'\n"
    ids = tokenizer.encode(text)
    assert ids[0] == EOS_ID  # bos is prepended, as Llama tokenizers do
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_training_the_tokenizer_twice_gives_the_same_merges():
    first = train_tokenizer(CODE, vocab_size=300).to_str()
    assert train_tokenizer(CODE, vocab_size=300).to_str() == first
