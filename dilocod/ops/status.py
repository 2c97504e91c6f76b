"""`dilocod status`: one short session with role "status" that asks for and prints a daemon's
status. The status schema belongs to the daemon; this module only fetches and formats it."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from dilocod.config import Address
from dilocod.transport.endpoints import connect
from dilocod.transport.options import TransportOptions
from dilocod.wire.messages import StatusRequest, StatusResponse


async def fetch_status(address: Address, *, secret: bytes | None, timeout_s: float) -> dict[str, Any]:
    options = TransportOptions(handshake_timeout_s=timeout_s)
    async with asyncio.timeout(timeout_s):
        session = await connect(
            address.host,
            address.port,
            peer_id=f"status-{os.getpid()}",
            role="status",
            secret=secret,
            streams=0,
            options=options,
        )
        try:
            await session.send(StatusRequest())
            while True:
                item = await session.recv()
                if isinstance(item, StatusResponse):
                    return item.status
        finally:
            await session.close("status read")


def format_status(status: dict[str, Any]) -> str:
    width = max((len(str(k)) for k in status), default=0)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in sorted(status.items()))
