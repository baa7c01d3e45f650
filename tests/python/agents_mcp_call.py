"""One tool call through the OpenAI Agents SDK's MCP adapter (`agents.mcp.MCPServerStreamableHttp`,
defaults), the way an agent run makes it: the server's tools listed, then the tool called. A new
process per call, no idempotency key, no model needed. Prints one JSON line like mcp_call.py.
Usage: agents_mcp_call.py URL TOOL ARGS_JSON (MCP_TOKEN: the bearer token). A JSON-RPC error
among what the adapter raised is reported with its code and data, like mcp_call.py does."""
import asyncio
import json
import os
import sys

from agents.mcp import MCPServerStreamableHttp
from mcp.shared.exceptions import McpError


def flat(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def mcp_error(e: BaseException):
    """The JSON-RPC error among what the adapter raised and its causes, if any: the adapter
    raises the client's McpError as it is or wrapped in its own exception."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, McpError):
            return x
        if isinstance(x, BaseExceptionGroup):
            stack.extend(x.exceptions)
        stack.extend([x.__cause__, x.__context__])
    return None


async def main() -> dict:
    url, tool, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    token = os.environ.get("MCP_TOKEN")
    params = {"url": url}
    if token:
        params["headers"] = {"Authorization": f"Bearer {token}"}
    async with MCPServerStreamableHttp(params=params, name="tools") as server:
        listed = await server.list_tools()
        if tool not in {t.name for t in listed}:
            return {"error": {"message": f"no tool {tool}"}}
        result = await server.call_tool(tool, args)
        meta = result.meta or {}
        return {
            "isError": result.isError,
            "text": [c.text for c in result.content if getattr(c, "text", None) is not None],
            "replayed": "io.idemproxy/replay" in meta,
            "progress": [],
            "asked": [],
        }


try:
    out = asyncio.run(asyncio.wait_for(main(), 40))
except BaseException as e:  # noqa: BLE001 - the test reads what the adapter raised
    rpc = mcp_error(e)
    e = flat(e)
    out = {"error": {"exception": type(e).__name__, "message": str(e)[:500]}}
    if rpc is not None:
        out["error"].update(code=rpc.error.code, data=rpc.error.data)
print(json.dumps(out))
