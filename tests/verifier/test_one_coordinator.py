"""One coordinator per verifier (`VerifierServicer._claim`): while a coordinator's stream is open, another
coordinator's messages are refused with FAILED_PRECONDITION; once that stream has closed, the next coordinator
takes the verifier over. Each stream is its own task, as gRPC's VerifyStream calls and socket connections are."""

import asyncio

import pytest

from specsplit.client.errors import FailedPrecondition
from specsplit.verifier.servicer import VerifierServicer


def test_a_second_coordinator_waits_until_the_first_ones_stream_closes():
    servicer = VerifierServicer(drafter=None, device="cpu")

    async def scenario():
        first_open, first_close = asyncio.Event(), asyncio.Event()

        async def first_stream():
            servicer._claim("coordinator-a")
            first_open.set()
            await first_close.wait()  # the stream stays open, idle
            servicer._claim("coordinator-a")  # its own later messages go through

        first = asyncio.create_task(first_stream())
        await first_open.wait()

        async def message(coordinator_id):
            servicer._claim(coordinator_id)

        refused = "serves coordinator 'coordinator-a'.*one coordinator per verifier"
        with pytest.raises(FailedPrecondition, match=refused):
            await asyncio.create_task(message("coordinator-b"))
        await asyncio.create_task(message("coordinator-a"))  # the same coordinator on another stream: its own
        first_close.set()
        await first
        await asyncio.create_task(message("coordinator-b"))  # a's streams are closed: b takes over

    asyncio.run(scenario())
