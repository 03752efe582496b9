"""Entry point of the `tokenizer` role: the SDK socket and the HTTP gateway."""
from __future__ import annotations

import asyncio
import signal

from common.config import ClusterConfig, model_dir
from services.tokenizer.service import TokenizerService


async def serve(config: ClusterConfig) -> None:
    from services.tokenizer.chat import ChatTemplate
    from services.tokenizer.http_server import HttpLimits
    from services.tokenizer.openai_api import OpenAIGateway

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    checkpoint = model_dir(config)
    service = TokenizerService(config, checkpoint)
    limits = HttpLimits(max_connections_per_client=config.http_max_connections_per_client)
    gateway = OpenAIGateway(service, ChatTemplate.from_model_dir(checkpoint), limits, pool=service.pool)

    async def serve_http(stop_event: asyncio.Event) -> None:
        await gateway.serve(config.http_host, config.http_port, stop_event)

    await service.run(stop, serve_http)


def run(config: ClusterConfig) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
