"""One tool call through Stripe's own Python agent toolkit (`stripe-agent-toolkit` 0.7.0), the way
an OpenAI Agents SDK tool invokes it: a new process, the toolkit's factory at its defaults
(it connects to https://mcp.stripe.com, lists the tools, then calls one), no idempotency key.
Prints one JSON line: the text the toolkit returned, or the error it raised.
Usage: stripe_toolkit_call.py TOOL ARGS_JSON (STRIPE_KEY in the environment: a restricted key)."""
import asyncio
import json
import os
import sys

from stripe_agent_toolkit.openai.toolkit import create_stripe_agent_toolkit


async def main() -> dict:
    tool, args = sys.argv[1], json.loads(sys.argv[2])
    toolkit = await create_stripe_agent_toolkit(secret_key=os.environ["STRIPE_KEY"])
    try:
        names = [t.name for t in toolkit.get_tools()]
        if tool not in names:
            return {"error": {"message": f"the toolkit offers no tool {tool}: {names}"}}
        # What the agent's FunctionTool does with the model's arguments (on_invoke_tool).
        return {"text": await toolkit.run_tool(tool, args)}
    finally:
        await toolkit.close()


try:
    out = asyncio.run(asyncio.wait_for(main(), 60))
except BaseException as e:  # noqa: BLE001 - the test reads what the toolkit raised
    # The toolkit wraps a failed call in RuntimeError(f"... {e}") raised from what the MCP
    # client raised, often an exception group: every message along the way, as a traceback
    # would show them.
    causes, seen, todo = [], set(), [e.__cause__, e.__context__]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        causes.append(f"{type(c).__name__}: {c}"[:800])
        todo += [c.__cause__, c.__context__]
        if isinstance(c, BaseExceptionGroup):
            todo += list(c.exceptions)
    out = {"error": {"exception": type(e).__name__, "message": str(e)[:800], "causes": causes}}
print(json.dumps(out))
