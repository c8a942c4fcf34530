"""propose() on a device hand-off (`specsplit/drafter/device_propose.py`): step 0 over every row of each request
(the rejected ones too), the later steps moved back on the device by num_sampled. The drafts equal the
host path's, fed only the valid rows, iteration after iteration; the items get the host's tokens."""

import llguidance
import pytest
import torch
from transformers import AutoTokenizer

from specsplit.drafter.device_propose import can_propose_on_device, shifted
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.drafter.servicer import DrafterServicer
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from specsplit.transport.base import DeviceTokens
from specsplit.transport.grpc_bytes import GrpcReceiver
from specsplit.transport.wire import fill_tensor_proto

PADDING = -1  # what the rejection sampler leaves past num_sampled


def kernel_runner(mtp, graphs: bool, tokenizer_dir=None) -> DrafterRunner:
    cache = mtp.make_kv_cache(64, 4)
    runner = DrafterRunner(mtp, cache, attention_kernel=True, cuda_graphs=False, tokenizer_dir=tokenizer_dir)
    if graphs:  # the static-buffer path of the CUDA graphs, run eagerly on the CPU
        runner.graphs = CudaGraphRunner(mtp, cache, max_model_len=128, max_num_tokens=8, capture=False)
    return runner


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("ks", [{"a": 3, "b": 2}, {"a": 0, "b": 2}], ids=["k3-k2", "k0-k2"])
def test_device_hand_off_drafts_equal_the_host_path(mtp, graphs, ks):
    """Two requests (k 3 and 2: ragged rows, a later step without one of them; or adaptive speculation's k 0 and 2:
    one that wants no drafts, step 0 only), prompt on the host path, then decode iterations with every num_sampled
    from 1 to k + 1, rejected rows holding padding and random hidden states."""
    g = torch.Generator().manual_seed(0)
    hidden_size, vocab = mtp.config.hidden_size, mtp.config.vocab_size
    device, host = kernel_runner(mtp, graphs), kernel_runner(mtp, False)
    prompt = {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13, 14]}
    items = [ProposeItem(r, 0, prompt[r][1:], k) for r, k in ks.items()]
    rows = torch.randn(sum(len(i.next_token_ids) for i in items), hidden_size, generator=g)
    assert device.propose(items, rows).drafts == host.propose(items, rows).drafts
    start = {r: len(prompt[r]) - 1 for r in ks}
    width = max(ks.values()) + 1
    for step, accepted in enumerate([(0, 0), (3, 2), (1, 2), (2, 1), (3, 0), (0, 1)]):
        num_sampled = [min(a, k) + 1 for a, k in zip(accepted, ks.values())]
        tokens = torch.full((len(ks), width), PADDING, dtype=torch.int64)
        for r, n in enumerate(num_sampled):
            tokens[r, :n] = torch.randint(3, vocab, (n,), generator=g)
        hidden = {r: torch.randn(k + 1, hidden_size, generator=g) for r, k in ks.items()}
        dev_items = [ProposeItem(r, start[r], [], k, num_rows=k + 1) for r, k in ks.items()]
        assert can_propose_on_device(device, dev_items)
        dev = DeviceTokens(tokens, torch.tensor(num_sampled))
        got = device.propose(dev_items, torch.cat([hidden[r] for r in ks]), dev)
        host_items = [
            ProposeItem(r, start[r], tokens[i, :n].tolist(), ks[r]) for i, (r, n) in enumerate(zip(ks, num_sampled))
        ]
        valid = torch.cat([hidden[r][:n] for r, n in zip(ks, num_sampled)])
        expected = host.propose(host_items, valid)
        assert got.drafts == expected.drafts, f"iteration {step}"
        assert [len(d) for d in got.drafts] == list(ks.values())
        for item, want, n, k in zip(dev_items, host_items, num_sampled, ks.values()):
            assert item.next_token_ids == want.next_token_ids and item.num_rejected == k + 1 - n
        for r, n in zip(ks, num_sampled):
            start[r] += n


def test_a_constrained_hand_off_masks_its_drafts_as_the_host_path_does(mtp, tiny_dir):
    """Structured output on a device hand-off: the item's output ends before the step (the verifier sent it before its
    step finished) and the drafter's masks follow the step's tokens from the device once they follow that output; its
    drafts equal the host path's, whose output includes them, and every draft is one the grammar allows after the
    output and the drafts before it."""
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-m]+")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    letters = [tok.convert_tokens_to_ids(c) for c in "abcdefghijklm"]
    g = torch.Generator().manual_seed(1)
    hidden_size, k = mtp.config.hidden_size, 3
    device, host = kernel_runner(mtp, False, tiny_dir), kernel_runner(mtp, False, tiny_dir)
    prompt, output = [5, 6, 7, 8, 9], [letters[0]]
    first = [ProposeItem("a", 0, prompt[1:] + output, k, grammar=grammar, output=list(output))]
    rows = torch.randn(len(prompt), hidden_size, generator=g)
    assert device.propose(first, rows).drafts == host.propose(first, rows).drafts
    start = len(prompt)
    for step, n in enumerate([1, 4, 2, 3, 1, 2]):  # num_sampled: the step's tokens, letters the grammar allows
        sampled = [letters[int(i)] for i in torch.randint(0, len(letters), (n,), generator=g)]
        tokens = torch.full((1, k + 1), PADDING, dtype=torch.int64)
        tokens[0, :n] = torch.tensor(sampled)
        hidden = torch.randn(k + 1, hidden_size, generator=g)
        dev_item = ProposeItem("a", start, [], k, num_rows=k + 1, grammar=grammar, output=list(output))
        got = device.propose([dev_item], hidden, DeviceTokens(tokens, torch.tensor([n])))
        host_item = ProposeItem("a", start, sampled, k, grammar=grammar, output=output + sampled)
        expected = host.propose([host_item], hidden[:n])
        assert got.drafts == expected.drafts, f"iteration {step}"
        assert dev_item.output == output and dev_item.next_token_ids == sampled  # the tokens went to the masks
        for draft in got.drafts[0]:
            assert draft == tok.eos_token_id or set(tok.convert_ids_to_tokens(draft)) <= set("abcdefghijklm")
        output, start = output + sampled, start + n


def test_shifted_moves_positions_context_and_slots_by_request(mtp):
    """A later step planned as if all was accepted, moved back by 0, 1 and 2 positions: the slot of
    each request's new token is its own block table's entry for the moved cache index."""
    cache = mtp.make_kv_cache(16, 4)
    cache.prepare_step(["a", "b", "c"], [6, 3, 9])
    plan = cache.plan_step(["a", "b", "c"], [1, 1, 1])  # cache indices 6, 3 and 9
    int64 = [torch.tensor(a) for a in plan.int64_arrays]
    int32 = [torch.tensor(a, dtype=torch.int32) for a in plan.int32_arrays]
    attn = plan.metadata(int64, int32, use_kernel=True)
    moved, positions = shifted(attn, torch.tensor([7, 4, 10]), torch.tensor([0, -1, -2]))
    assert positions.tolist() == [7, 3, 8]
    assert moved.token_context_lens.tolist() == [7, 3, 8]
    tables = {r: cache.block_table(r) for r in "abc"}
    want = [tables["a"][6 // 4] * 4 + 6 % 4, tables["b"][2 // 4] * 4 + 2 % 4, tables["c"][7 // 4] * 4 + 7 % 4]
    assert moved.slot_mapping.tolist() == want


def test_only_greedy_drafts_on_the_kernel_path_take_the_device_path(mtp):
    runner = kernel_runner(mtp, False)
    greedy = ProposeItem("a", 3, [], 3, num_rows=4)
    assert can_propose_on_device(runner, [greedy])
    assert not can_propose_on_device(runner, [greedy, ProposeItem("b", 3, [], 3, temperature=0.7, num_rows=4)])
    assert not can_propose_on_device(runner, [ProposeItem("a", 3, [], 0, num_rows=1)])  # nobody wants drafts
    assert can_propose_on_device(runner, [greedy, ProposeItem("b", 3, [], 0, num_rows=1)])
    assert not can_propose_on_device(runner, [])
    eager = DrafterRunner(mtp, mtp.make_kv_cache(8, 4), attention_kernel=False, cuda_graphs=False)
    assert not can_propose_on_device(eager, [greedy])


class FakeReceiver:
    """Rows and tokens in CPU tensors, as a cuda_ipc slot would hold them."""

    name = "fake"
    device_hand_off = True

    def __init__(self, rows, tokens, num_sampled):
        self.rows, self.tokens, self.num_sampled, self.waits = rows, tokens, num_sampled, 0

    def receive(self, msg):
        return self.rows

    def device_tokens(self, msg):
        def wait():
            self.waits += 1

        return DeviceTokens(self.tokens, self.num_sampled, wait)

    def release(self):
        pass


@pytest.mark.parametrize("kernel", [True, False], ids=["device-path", "host-fallback"])
def test_drafter_servicer_serves_a_device_hand_off_like_the_host_path(mtp, kernel):
    """Through the servicer: a tokens_on_device Propose gets the drafts a host-path Propose with the valid
    rows gets, on the device path (kernel runner) or, where the runner cannot take it, by waiting for the
    tokens on the host first (eager runner); either way its wait is queued once."""

    g = torch.Generator().manual_seed(1)
    hidden_size = mtp.config.hidden_size
    info = common_pb2.ModelInfo(vocab_size=mtp.config.vocab_size)

    def servicer(receiver):
        runner = kernel_runner(mtp, False) if kernel else DrafterRunner(mtp, mtp.make_kv_cache(64, 4))
        s = DrafterServicer()
        s.ready(runner, info, receiver)
        return s

    rows = torch.randn(4 + 3, hidden_size, generator=g)
    tokens = torch.tensor([[7, 8, 9, 10], [11, 12, PADDING, PADDING]])
    num_sampled = torch.tensor([3, 2])
    msg = drafter_pb2.ProposeRequest(iteration=1)
    msg.requests.add(request_id="a", start_position=0, num_spec_tokens=3, num_rows=4)
    msg.requests.add(request_id="b", start_position=0, num_spec_tokens=2, num_rows=3)
    msg.hidden_states_handle.tokens_on_device, msg.hidden_states_handle.token_width = True, 4
    receiver = FakeReceiver(rows, tokens, num_sampled)
    got = servicer(receiver).handle_local_request(msg)
    host = drafter_pb2.ProposeRequest(iteration=1)
    host.requests.add(request_id="a", start_position=0, next_token_ids=[7, 8, 9], num_spec_tokens=3, num_rejected=1)
    host.requests.add(request_id="b", start_position=0, next_token_ids=[11, 12], num_spec_tokens=2, num_rejected=1)
    fill_tensor_proto(host.hidden_states, torch.cat([rows[:3], rows[4:6]]))
    plain = DrafterServicer()
    plain.ready(DrafterRunner(mtp, mtp.make_kv_cache(64, 4)), info, GrpcReceiver("cpu", hidden_size))
    want = plain.handle_local_request(host)
    assert [list(d.token_ids) for d in got.drafts] == [list(d.token_ids) for d in want.drafts]
    assert [len(d.token_ids) for d in got.drafts] == [3, 2] and receiver.waits == 1
