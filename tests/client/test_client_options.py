"""The SDK refuses an option its request cannot hold with InvalidArgument naming the option, before any call
(no server at the address: a call would fail otherwise), for the blocking and the asyncio client alike."""

import asyncio

import grpc
import pytest

from specsplit import AsyncClient, Client
from specsplit.client.errors import InvalidArgument

BAD = [
    ({"seed": -1}, "seed=-1 cannot be sent: Value out of range"),
    ({"max_tokens": 2**31}, "max_tokens=2147483648 cannot be sent: Value out of range"),
    ({"top_k": "5"}, "top_k='5' cannot be sent:"),
    ({"num_speculative_tokens": 2**40}, "num_speculative_tokens=1099511627776 cannot be sent: Value out of range"),
    ({"stop": [3]}, "stop=[3] cannot be sent:"),
]


@pytest.mark.parametrize("options, says", BAD, ids=[next(iter(o)) for o, _ in BAD])
def test_an_option_the_request_cannot_hold_is_invalid_argument_naming_it(options, says):
    with Client("127.0.0.1:1", timeout=5) as client, pytest.raises(InvalidArgument) as err:
        client.generate("hi", **options)
    assert str(err.value).startswith(says) and err.value.code == grpc.StatusCode.INVALID_ARGUMENT

    async def async_generate():
        async with AsyncClient("127.0.0.1:1", timeout=5) as client:
            await client.generate("hi", **options)

    with pytest.raises(InvalidArgument, match="cannot be sent"):
        asyncio.run(async_generate())
