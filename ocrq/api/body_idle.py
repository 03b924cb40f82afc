"""A cap on how long a request body may pause (OCRQ_API_BODY_IDLE_S), checked while it arrives.

Why: uvicorn waits for the rest of a body as long as the client keeps the connection open.
An upload that stalled held its connection and its partial file for 150 s and more (issue 52);
many of them hold the api's upload slots and disk. Here each wait for the next part of a body
is bounded: past the limit the request ends in a 408 (the route's upload, if any, removes its
partial file as for any failed read: uploads.py) and uvicorn closes the connection, whose body
was never read to its end. Once the body is complete, waits (a long-poll listening for the
client to go away) are not bounded.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyIdle:
    def __init__(self, app: ASGIApp, idle_s: float) -> None:
        self.app = app
        self.idle_s = idle_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        complete = False

        async def bounded() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except TimeoutError:
                # Raised inside the route's body read, as json_budget.py's 413.
                raise HTTPException(
                    408, f"the request body paused for over {self.idle_s:g} s "
                    "(OCRQ_API_BODY_IDLE_S): send it without stalling, or resume from the start"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, bounded, send)
