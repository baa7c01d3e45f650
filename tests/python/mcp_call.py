"""One tool call with the official MCP Python client, as an agent's tool makes it: a new process,
defaults, no idempotency key. Prints one JSON line: the result, or the error the client raised.
Usage: mcp_call.py URL TOOL ARGS_JSON (MCP_TOKEN in the environment: the bearer token;
MCP_ELICIT_DELAY: seconds the person takes to answer an elicitation)."""
import asyncio
import json
import os
import sys

from mcp import ClientSession, types
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError


def flat(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


async def main() -> dict:
    url, tool, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    token = os.environ.get("MCP_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    progress = []

    async def on_progress(p, total, message):
        progress.append(p)

    asked = []

    async def on_elicit(context, params):
        asked.append(params.message)
        await asyncio.sleep(float(os.environ.get("MCP_ELICIT_DELAY", "0")))
        return types.ElicitResult(action="accept", content={"ok": True})

    async with streamablehttp_client(url, headers=headers) as (read, write, _):
        async with ClientSession(read, write, elicitation_callback=on_elicit) as session:
            await session.initialize()
            result = await session.call_tool(tool, args, progress_callback=on_progress)
            meta = result.meta or {}
            return {
                "isError": result.isError,
                "text": [c.text for c in result.content if getattr(c, "text", None) is not None],
                "structured": result.structuredContent,
                "replayed": "io.idemproxy/replay" in meta,
                "progress": progress,
                "asked": asked,
            }


try:
    out = asyncio.run(asyncio.wait_for(main(), 40))
except BaseException as e:  # noqa: BLE001 - the test reads what the client raised
    e = flat(e)
    if isinstance(e, McpError):
        out = {"error": {"code": e.error.code, "message": e.error.message, "data": e.error.data}}
    else:
        out = {"error": {"exception": type(e).__name__, "message": str(e)[:500]}}
print(json.dumps(out))
