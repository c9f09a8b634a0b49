"""A stand-in HTTP server on 127.0.0.1 for tests: aiohttp routes on a free port, stopped when the block ends."""

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def loopback_server(routes: dict[tuple[str, str], Handler]) -> AsyncIterator[str]:
    """Serve `routes` ({(method, path): handler}) on 127.0.0.1; yields the base URL, `http://127.0.0.1:<port>`."""
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    try:
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
