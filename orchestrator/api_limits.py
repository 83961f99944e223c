"""The request body limit, for every body: read before the app sees it, refused at the limit.

A ``Content-Length`` over the limit is refused at once; a chunked body is read until it passes the limit, then
refused without reading on (413). A body that is not UTF-8 is refused too (400): every body thinkpool takes is
UTF-8 JSON. The app then reads the body it was given, and a streaming response still hears the client leave.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.api_errors import error_response


class BodyLimit:
    """ASGI middleware: 413 past ``max_bytes`` (chunked or not), 400 for a body that is not UTF-8."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_long = int(declared) > self.max_bytes
            except ValueError:
                await error_response(path, 400, "Content-Length: not a number")(scope, receive, send)
                return
            if too_long:
                await self._too_large(path, scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body ended
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(path, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as error:
            message = f"body: not UTF-8 (byte {error.start}); bodies are UTF-8 JSON"
            await error_response(path, 400, message)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, for streaming responses

        await self.app(scope, replay, send)

    async def _too_large(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(path, 413, f"request body over {self.max_bytes} bytes", {"Connection": "close"})
        await response(scope, receive, send)
