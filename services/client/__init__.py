"""The Baton client SDK: talk to a cluster's tokenizer over ZeroMQ.

    from services.client import Client
    with Client("tcp://127.0.0.1:7101") as client:
        result = client.generate("Hello", max_tokens=32, temperature=0)
        for chunk in client.stream("Hello", max_tokens=32):
            print(chunk.text, end="")

`AsyncClient` is the asyncio twin. Failures raise the typed errors re-exported here.
The SDK needs pyzmq, msgspec and numpy only (no torch).
"""
from common.errors import (
                           BatonError,
                           InvalidRequest,
                           Rejected,
                           RequestTimeout,
                           ServerUnavailable,
                           Unauthorized,
                           WorkerLost,
)
from services.client._shared import Result, StreamChunk, curve_keys
from services.client.async_client import AsyncClient
from services.client.sync_client import Client

__all__ = ["AsyncClient", "BatonError", "Client", "InvalidRequest", "Rejected", "RequestTimeout", "Result",
           "ServerUnavailable", "StreamChunk", "Unauthorized", "WorkerLost", "curve_keys"]
