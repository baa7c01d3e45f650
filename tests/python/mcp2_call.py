"""One tool call with the official MCP Python client 2.x (`mcp.Client`, defaults: it probes
`server/discover` and speaks the 2026-07-28 revision to a server that does), as an agent's
tool makes it: a new process, no idempotency key. Prints one JSON line: the result, or the error
the client raised. Usage: mcp2_call.py URL TOOL ARGS_JSON (MCP_TOKEN: the bearer token)."""
import asyncio
import json
import os
import sys

from mcp import Client
from mcp_types import ElicitResult
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError


def flat(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


async def main() -> dict:
    url, tool, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    token = os.environ.get("MCP_TOKEN")
    target = url
    if token:
        headers = {"Authorization": f"Bearer {token}"}
        target = streamable_http_client(url, http_client=create_mcp_http_client(headers=headers))
    progress = []

    async def on_progress(p, total, message):
        progress.append(p)

    asked = []

    async def on_elicit(context, params):
        asked.append(params.message)
        return ElicitResult(action="accept", content={"ok": True})

    async with Client(target, elicitation_callback=on_elicit) as client:
        result = await client.call_tool(tool, args, progress_callback=on_progress)
        meta = result.meta or {}
        return {
            "isError": result.is_error,
            "text": [c.text for c in result.content if getattr(c, "text", None) is not None],
            "structured": result.structured_content,
            "replayed": "io.idemproxy/replay" in meta,
            "progress": progress,
            "asked": asked,
            "protocol": str(getattr(client.session, "protocol_version", "")),
        }


try:
    out = asyncio.run(asyncio.wait_for(main(), 40))
except BaseException as e:  # noqa: BLE001 - the test reads what the client raised
    e = flat(e)
    if isinstance(e, MCPError):
        out = {"error": {"code": e.error.code, "message": e.error.message, "data": e.error.data}}
    else:
        out = {"error": {"exception": type(e).__name__, "message": str(e)[:500]}}
print(json.dumps(out, default=str))
