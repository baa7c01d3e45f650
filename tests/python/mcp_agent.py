"""An agent that calls one MCP tool over stdio the way CrewAI's MCP stdio transport does
(crewai/mcp/transports/stdio.py): the server's environment is
mcp.client.stdio.get_default_environment() plus the `env` the user configured, here only
STRIPE_API_KEY. One invocation is one run of the agent's tool call.

    mcp_agent.py SERVER_SCRIPT INVOICE AMOUNT

Prints the tool's result (one JSON line), or {"error"}.
"""
import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import get_default_environment, stdio_client


async def call(server_script, invoice, amount):
    env = get_default_environment()
    env.update({"STRIPE_API_KEY": os.environ["STRIPE_API_KEY"]})
    params = StdioServerParameters(command=sys.executable, args=[server_script], env=env)
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            result = await session.call_tool("pay_invoice", {"invoice": invoice, "amount": int(amount)})
            if result.isError:
                return {"error": "tool error", "message": " ".join(c.text for c in result.content)[:300]}
            return json.loads(result.content[0].text)


def main(argv):
    try:
        out = asyncio.run(asyncio.wait_for(call(argv[1], argv[2], argv[3]), 60))
    except Exception as e:
        out = {"error": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)[:300]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
