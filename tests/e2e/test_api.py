"""Client-facing API: health and reflection on every service, model info, abort, cancel, deadlines."""

import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specsplit import AsyncClient, Client, SpecsplitError
from specsplit.proto import common_pb2, verifier_pb2, verifier_pb2_grpc

from .helpers import assert_kv_all_free, free_kv_blocks, wait_idle


@pytest.mark.parametrize(
    "role, service",
    [
        ("coordinator", "specsplit.v1.Coordinator"),
        ("verifier", "specsplit.v1.Verifier"),
        ("drafter", "specsplit.v1.Drafter"),
    ],
)
def test_every_service_serves_health_and_reflection(cluster, role, service):
    with grpc.insecure_channel(cluster.services[role].address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (resp,) = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in resp.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names


def test_model_info(cluster):
    with Client(cluster.address, timeout=10) as client:
        info = client.model_info()
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size > 0
    assert info.num_speculative_tokens == 3 and info.max_model_len > 0


def test_abort_by_id_ends_the_stream_with_abort(cluster):
    with Client(cluster.address, timeout=60) as client:
        reasons = []
        for delta in client.stream(prompt_token_ids=[4, 5], max_tokens=400, ignore_eos=True, request_id="to-abort"):
            if delta.token_ids and not reasons:
                reasons.append("started")
                assert client.abort("to-abort")
            if delta.finish_reason:
                reasons.append(delta.finish_reason)
        assert reasons == ["started", "abort"]
        assert not client.abort("to-abort")
        wait_idle(client)


def test_cancelling_the_stream_aborts_the_request(cluster):
    with Client(cluster.address, timeout=60) as client:
        stream = client.stream(prompt_token_ids=[4, 5], max_tokens=400, ignore_eos=True)
        next(stream)
        stream.close()  # cancels the RPC
        wait_idle(client)


def test_deadline_is_honoured_and_the_request_aborted(cluster):
    with Client(cluster.address) as client:
        longest = client.model_info().max_model_len - 2  # all the model's length allows
        with pytest.raises(SpecsplitError) as err:
            client.generate(prompt_token_ids=[4, 5], max_tokens=longest, ignore_eos=True, timeout=0.5)
        assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(client)


def test_async_client_mirrors_the_blocking_one(cluster):
    import asyncio

    async def main():
        async with AsyncClient(cluster.address, timeout=60) as client:
            outs = await asyncio.gather(*[client.generate(prompt_token_ids=[9, i], max_tokens=6) for i in range(3)])
            return outs

    outs = asyncio.run(main())
    with Client(cluster.address, timeout=60) as client:
        for i, out in enumerate(outs):
            assert out.token_ids == client.generate(prompt_token_ids=[9, i], max_tokens=6).token_ids


def test_server_stats_aggregate_requests(cluster):
    with Client(cluster.address, timeout=60) as client:
        before, pb0 = client.server_stats()
        out = client.generate(prompt_token_ids=[3, 3, 3], max_tokens=10, ignore_eos=True)
        after, pb1 = client.server_stats()
    assert pb1.num_finished_requests == pb0.num_finished_requests + 1
    assert after.num_draft_tokens - before.num_draft_tokens == out.stats.num_draft_tokens


def test_concurrent_threads_share_one_client(cluster):
    with Client(cluster.address, timeout=60) as client:
        outs = [None] * 4

        def run(i):
            outs[i] = client.generate(prompt_token_ids=[i + 3], max_tokens=5, ignore_eos=True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert all(o is not None and len(o.token_ids) == 5 for o in outs)


def test_kv_blocks_on_verifier_and_drafter_are_free_after_finish_and_abort(cluster):
    with Client(cluster.address, timeout=60) as client:
        client.generate(prompt_token_ids=list(range(3, 60)), max_tokens=5)
        stream = client.stream(prompt_token_ids=list(range(3, 40)), max_tokens=300, ignore_eos=True)
        next(stream)
        stream.close()
        wait_idle(client)
    assert_kv_all_free(cluster)


def test_a_coordinator_taking_the_verifier_over_leaves_no_kv_of_the_old_ones_requests(cluster):
    """The old coordinator's last finished ids may never come (it stopped): when a new coordinator takes the
    verifier over, the verifier frees its own KV and every request it placed on a drafter. Here the test is both
    coordinators, one Verify stream per message, after the cluster's own coordinator is gone."""

    def verify(coordinator_id: str, iteration: int, request_id: str | None = None, finished: tuple[str, ...] = ()):
        msg = verifier_pb2.VerifyRequest(
            iteration=iteration, coordinator_id=coordinator_id, finished_request_ids=list(finished)
        )
        if request_id is not None:  # a prefill that samples and asks for drafts: the drafter holds its MTP KV
            msg.requests.add(
                request_id=request_id, token_ids=[5, 6, 7, 8, 9], sample=True, num_spec_tokens=2,
                sampling=common_pb2.SamplingParams(top_p=1.0),
            )  # fmt: skip
        with grpc.insecure_channel(cluster.services["verifier"].address) as ch:
            return next(verifier_pb2_grpc.VerifierStub(ch).VerifyStream(iter([msg]), timeout=30))

    cluster.kill("coordinator", signal.SIGKILL)
    try:
        _, _, d_free_before, _ = free_kv_blocks(cluster)  # (a drafter an earlier test's faults left KV on: counted)
        assert verify("old", 1, "left-behind").results[0].sampled_token_ids  # never finished by "old"
        assert verify("new", 1, "fresh").results[0].sampled_token_ids  # takes over
        verify("new", 2, finished=("fresh",))  # an iteration that only frees
        v_free, v_total, d_free, _ = free_kv_blocks(cluster)
        assert v_free == v_total and d_free >= d_free_before  # without the takeover's frees: "left-behind"'s
    finally:
        cluster.restart("coordinator")
    with Client(cluster.address, timeout=60) as client:
        assert len(client.generate(prompt_token_ids=[3, 4], max_tokens=4, ignore_eos=True).token_ids) == 4
