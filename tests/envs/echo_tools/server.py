"""The `echo-tools` MCP server (started by verifiers as `python -m echo_tools.server`)."""

import asyncio

import verifiers.v1 as vf


class EchoConfig(vf.SharedToolsetConfig):
    pass


class Echo(vf.Toolset[EchoConfig]):
    TOOL_PREFIX = None

    @vf.tool
    async def echo(self, text: str) -> str:
        """Answer the text."""
        return text

    @vf.tool
    async def sleep(self, seconds: float) -> str:
        """Answer after `seconds`."""
        await asyncio.sleep(seconds)
        return "awake"


if __name__ == "__main__":
    Echo.run()
