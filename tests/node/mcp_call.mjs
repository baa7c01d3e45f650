// One tool call with the official MCP TypeScript SDK (@modelcontextprotocol/sdk), as an agent's
// tool makes it: a new process, defaults, no idempotency key. Nothing here names the proxy or
// its CA: the worker's environment does (tests/it/mcp.rs).
//
//     node mcp_call.mjs URL TOOL ARGS_JSON      (MCP_TOKEN: the bearer token)
//
// Prints one JSON line: the result, or the error the client threw.
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { ElicitRequestSchema } from '@modelcontextprotocol/sdk/types.js';

const [url, tool, args] = process.argv.slice(2);
const token = process.env.MCP_TOKEN;
const options = token ? { requestInit: { headers: { Authorization: `Bearer ${token}` } } } : undefined;
const progress = [];
const asked = [];
let out;
try {
  const client = new Client({ name: 'tool', version: '1.0.0' }, { capabilities: { elicitation: {} } });
  client.setRequestHandler(ElicitRequestSchema, async (request) => {
    asked.push(request.params.message);
    return { action: 'accept', content: { ok: true } };
  });
  await client.connect(new StreamableHTTPClientTransport(new URL(url), options));
  const result = await client.callTool({ name: tool, arguments: JSON.parse(args) }, undefined, {
    onprogress: (p) => progress.push(p.progress),
  });
  out = {
    isError: result.isError ?? false,
    text: result.content.filter((c) => c.type === 'text').map((c) => c.text),
    replayed: Boolean(result._meta && result._meta['io.idemproxy/replay']),
    progress,
    asked,
  };
  await client.close();
} catch (e) {
  out = { error: { code: e.code, message: String(e.message).slice(0, 500), data: e.data } };
}
console.log(JSON.stringify(out));
process.exit(0);
