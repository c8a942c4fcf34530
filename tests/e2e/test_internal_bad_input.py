"""Bad input on the internal RPCs (Verify, Propose) is refused with INVALID_ARGUMENT or
FAILED_PRECONDITION and a clear message, and the services keep serving; a second coordinator is refused."""

import signal
import subprocess
import sys
import time

import grpc
import pytest

from specsplit import Client
from specsplit.proto import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specsplit.rpc.process import free_port

from .helpers import assert_kv_all_free

Code = grpc.StatusCode


def _hidden(rows: int, cols: int, dtype=common_pb2.DTYPE_FLOAT32, nbytes: int | None = None):
    size = rows * cols * 4 if nbytes is None else nbytes
    return common_pb2.Tensor(dtype=dtype, shape=[rows, cols], data=b"\0" * size)


@pytest.fixture
def hidden_size(cluster):
    with grpc.insecure_channel(cluster.services["drafter"].address) as ch:
        return drafter_pb2_grpc.DrafterStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10).hidden_size


def _propose(cluster, msg):
    with grpc.insecure_channel(cluster.services["drafter"].address) as ch:
        return next(drafter_pb2_grpc.DrafterStub(ch).ProposeStream(iter([msg]), timeout=10))


def _item(**kw):
    base = dict(request_id="x", start_position=0, next_token_ids=[5, 6], num_spec_tokens=2)
    return drafter_pb2.ProposeItem(**{**base, **kw})


@pytest.mark.parametrize(
    "case, code, message",
    [
        ("wrong dtype", Code.INVALID_ARGUMENT, "hidden_states"),
        ("wrong shape", Code.INVALID_ARGUMENT, "hidden_states"),
        ("wrong byte length", Code.INVALID_ARGUMENT, "hidden_states"),
        ("negative position", Code.INVALID_ARGUMENT, "negative start_position"),
        ("num_rejected too large", Code.INVALID_ARGUMENT, "num_rejected"),
        ("token outside vocabulary", Code.INVALID_ARGUMENT, "outside the vocabulary"),
    ],
)
def test_bad_propose_is_refused_and_the_drafter_keeps_serving(cluster, hidden_size, case, code, message):
    h = hidden_size
    msg = {
        "wrong dtype": drafter_pb2.ProposeRequest(
            requests=[_item()], hidden_states=_hidden(2, h, common_pb2.DTYPE_INT64)
        ),
        "wrong shape": drafter_pb2.ProposeRequest(requests=[_item()], hidden_states=_hidden(3, h)),
        "wrong byte length": drafter_pb2.ProposeRequest(requests=[_item()], hidden_states=_hidden(2, h, nbytes=7)),
        "negative position": drafter_pb2.ProposeRequest(
            requests=[_item(start_position=-4)], hidden_states=_hidden(2, h)
        ),
        "num_rejected too large": drafter_pb2.ProposeRequest(
            requests=[_item(num_rejected=1000)], hidden_states=_hidden(2, h)
        ),
        "token outside vocabulary": drafter_pb2.ProposeRequest(
            requests=[_item(next_token_ids=[10**7, 1])], hidden_states=_hidden(2, h)
        ),
    }[case]
    with pytest.raises(grpc.RpcError) as err:
        _propose(cluster, msg)
    assert err.value.code() is code and message in err.value.details()
    ok = _propose(cluster, drafter_pb2.ProposeRequest(requests=[_item(request_id="fine")], hidden_states=_hidden(2, h)))
    assert len(ok.drafts[0].token_ids) == 2
    assert_kv_all_free(cluster)  # its stream closed: the drafter freed what was placed through it


def _model_info(cluster) -> common_pb2.ModelInfo:
    with grpc.insecure_channel(cluster.services["verifier"].address) as ch:
        return verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)


def _verify(cluster, msg):
    with grpc.insecure_channel(cluster.services["verifier"].address) as ch:
        return next(verifier_pb2_grpc.VerifierStub(ch).VerifyStream(iter([msg]), timeout=30))


def test_bad_verify_is_refused_and_everything_keeps_serving(cluster):
    """A second coordinator is refused while the cluster's own holds its stream to the verifier; once that one is
    gone, the test's Verifies are the verifier's coordinator's, and the bad ones among them are refused."""

    def req(it, **kw):
        base = dict(
            request_id="intruder",
            num_computed_tokens=0,
            token_ids=[5, 6],
            sample=True,
            sampling=common_pb2.SamplingParams(top_p=1.0),
        )
        return verifier_pb2.VerifyRequest(
            iteration=it, coordinator_id="test-intruder", requests=[verifier_pb2.ScheduledRequest(**{**base, **kw})]
        )

    with Client(cluster.address, timeout=60) as client:  # the cluster's coordinator has its stream open
        assert client.generate(prompt_token_ids=[3, 4], max_tokens=2, ignore_eos=True).token_ids
    with pytest.raises(grpc.RpcError) as err:
        _verify(cluster, req(1))
    assert err.value.code() is Code.FAILED_PRECONDITION and "one coordinator per verifier" in err.value.details()
    holder = _model_info(cluster).coordinator_id
    assert holder  # the verifier says who holds it; a coordinator starting against it stops with one line
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "specsplit",
            "serve",
            "coordinator",
            "--model",
            cluster.model,
            "--port",
            str(free_port()),
            "--verifier",
            cluster.services["verifier"].address,
            "--startup-timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2, second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert f"serves another coordinator ({holder})" in line and "one coordinator per verifier" in line
    cluster.kill("coordinator", signal.SIGKILL)  # its stream closes with it
    deadline = time.monotonic() + 10
    while _model_info(cluster).coordinator_id:  # the verifier notices the closed stream
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cases = [
        (req(1, request_id="ghost", num_computed_tokens=7), Code.FAILED_PRECONDITION, "re-prefill"),
        (req(2, num_computed_tokens=-1), Code.INVALID_ARGUMENT, "negative"),
        (req(3, token_ids=[5, 10**7]), Code.INVALID_ARGUMENT, "outside the vocabulary"),
        (req(4, num_draft_tokens=5), Code.INVALID_ARGUMENT, "num_draft_tokens"),
    ]
    for msg, code, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            _verify(cluster, msg)
        assert err.value.code() is code and message in err.value.details(), msg
    assert _verify(cluster, req(10)).results[0].sampled_token_ids
    with pytest.raises(grpc.RpcError) as err:  # iterations of one coordinator must increase
        _verify(cluster, req(9))
    assert err.value.code() is Code.FAILED_PRECONDITION and "strictly increase" in err.value.details()
    # A coordinator started again takes the verifier over (the test's streams are closed) and starts afresh.
    cluster.restart("coordinator")
    with Client(cluster.address, timeout=60) as client:
        assert len(client.generate(prompt_token_ids=[3, 4], max_tokens=6, ignore_eos=True).token_ids) == 6
