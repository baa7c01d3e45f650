// A reference MCP server for the official conformance suite's server scenarios, built with the
// official TypeScript SDK (the low-level `Server`, Streamable HTTP with sessions, an event
// store for SSE polling, and the SDK's own DNS rebinding protection for localhost). Every
// tool, resource and prompt is the one a scenario asks for by name. Run by
// scripts/mcp-conformance.sh: `node server.mjs PORT`. It listens on 127.0.0.1 only.
import { randomUUID } from 'node:crypto';

import { createMcpExpressApp } from '@modelcontextprotocol/sdk/server/express.js';
import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { InMemoryEventStore } from '@modelcontextprotocol/sdk/examples/shared/inMemoryEventStore.js';
import {
  CallToolRequestSchema,
  CompleteRequestSchema,
  GetPromptRequestSchema,
  ListPromptsRequestSchema,
  ListResourcesRequestSchema,
  ListResourceTemplatesRequestSchema,
  ListToolsRequestSchema,
  ReadResourceRequestSchema,
  SubscribeRequestSchema,
  UnsubscribeRequestSchema,
  isInitializeRequest,
} from '@modelcontextprotocol/sdk/types.js';

const port = Number(process.argv[2] || 3000);
// A 1x1 PNG and a tiny WAV header, base64.
const PNG =
  'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==';
const WAV = 'UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQAAAAA=';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const text = (t) => ({ content: [{ type: 'text', text: t }] });
const noArgs = { type: 'object', properties: {} };

const tools = [
  ['test_simple_text', 'Returns simple text', noArgs],
  ['test_image_content', 'Returns an image', noArgs],
  ['test_audio_content', 'Returns audio', noArgs],
  ['test_embedded_resource', 'Returns an embedded resource', noArgs],
  ['test_multiple_content_types', 'Returns text, image and resource', noArgs],
  ['test_tool_with_logging', 'Logs while it runs', noArgs],
  ['test_error_handling', 'Always fails', noArgs],
  ['test_tool_with_progress', 'Reports progress', noArgs],
  ['test_sampling', 'Asks the client to sample', { type: 'object', properties: { prompt: { type: 'string' } }, required: ['prompt'] }],
  ['test_elicitation', 'Asks the user', { type: 'object', properties: { message: { type: 'string' } }, required: ['message'] }],
  ['test_elicitation_sep1034_defaults', 'Asks with defaults', noArgs],
  ['test_elicitation_sep1330_enums', 'Asks with enums', noArgs],
  ['test_reconnection', 'Closes its stream early, answers on the resumed one', noArgs],
  [
    'json_schema_2020_12_tool',
    'Takes a JSON Schema 2020-12 input',
    {
      $schema: 'https://json-schema.org/draft/2020-12/schema',
      type: 'object',
      $defs: { address: { type: 'object', properties: { street: { type: 'string' } } } },
      properties: { name: { type: 'string' }, address: { $ref: '#/$defs/address' } },
      additionalProperties: false,
    },
  ],
].map(([name, description, inputSchema]) => ({ name, description, inputSchema }));

const calls = {
  test_simple_text: async () => text('This is a simple text response for testing.'),
  test_image_content: async () => ({ content: [{ type: 'image', data: PNG, mimeType: 'image/png' }] }),
  test_audio_content: async () => ({ content: [{ type: 'audio', data: WAV, mimeType: 'audio/wav' }] }),
  test_embedded_resource: async () => ({
    content: [{ type: 'resource', resource: { uri: 'test://embedded-resource', mimeType: 'text/plain', text: 'Embedded.' } }],
  }),
  test_multiple_content_types: async () => ({
    content: [
      { type: 'text', text: 'Multiple content types test:' },
      { type: 'image', data: PNG, mimeType: 'image/png' },
      { type: 'resource', resource: { uri: 'test://mixed-content-resource', mimeType: 'application/json', text: '{"test":"data","value":123}' } },
    ],
  }),
  test_tool_with_logging: async (_args, extra) => {
    for (const [i, data] of ['Tool execution started', 'Tool processing data', 'Tool execution completed'].entries()) {
      if (i > 0) await sleep(50);
      await extra.sendNotification({ method: 'notifications/message', params: { level: 'info', data } });
    }
    return text('Logged three messages.');
  },
  test_error_handling: async () => ({ isError: true, ...text('This tool intentionally returns an error for testing') }),
  test_tool_with_progress: async (_args, extra) => {
    const progressToken = extra._meta?.progressToken;
    for (const [i, progress] of [0, 50, 100].entries()) {
      if (i > 0) await sleep(50);
      if (progressToken !== undefined) {
        await extra.sendNotification({ method: 'notifications/progress', params: { progressToken, progress, total: 100 } });
      }
    }
    return text('Progress reported.');
  },
  test_sampling: async (args, extra, server) => {
    const answer = await server.createMessage(
      { messages: [{ role: 'user', content: { type: 'text', text: args.prompt } }], maxTokens: 100 },
      { relatedRequestId: extra.requestId },
    );
    return text(`LLM response: ${answer.content?.text ?? ''}`);
  },
  test_elicitation: async (args, extra, server) => {
    const schema = {
      type: 'object',
      properties: { username: { type: 'string', description: "User's response" }, email: { type: 'string', description: "User's email address" } },
      required: ['username', 'email'],
    };
    const answer = await server.elicitInput({ message: args.message, requestedSchema: schema }, { relatedRequestId: extra.requestId });
    return text(`User response: ${JSON.stringify(answer)}`);
  },
  test_elicitation_sep1034_defaults: async (_args, extra, server) => {
    const schema = {
      type: 'object',
      properties: {
        name: { type: 'string', default: 'John Doe' },
        age: { type: 'integer', default: 30 },
        score: { type: 'number', default: 95.5 },
        status: { type: 'string', enum: ['active', 'inactive', 'pending'], default: 'active' },
        verified: { type: 'boolean', default: true },
      },
    };
    const answer = await server.elicitInput({ message: 'Defaults', requestedSchema: schema }, { relatedRequestId: extra.requestId });
    return text(`User response: ${JSON.stringify(answer)}`);
  },
  test_elicitation_sep1330_enums: async (_args, extra, server) => {
    const schema = {
      type: 'object',
      properties: {
        untitledSingle: { type: 'string', enum: ['option1', 'option2', 'option3'] },
        titledSingle: { type: 'string', oneOf: [{ const: 'value1', title: 'First' }, { const: 'value2', title: 'Second' }] },
        legacyEnum: { type: 'string', enum: ['opt1', 'opt2'], enumNames: ['Option One', 'Option Two'] },
        untitledMulti: { type: 'array', items: { type: 'string', enum: ['option1', 'option2', 'option3'] } },
        titledMulti: { type: 'array', items: { anyOf: [{ const: 'value1', title: 'First' }, { const: 'value2', title: 'Second' }] } },
      },
    };
    const answer = await server.elicitInput({ message: 'Enums', requestedSchema: schema }, { relatedRequestId: extra.requestId });
    return text(`User response: ${JSON.stringify(answer)}`);
  },
  test_reconnection: async (_args, extra) => {
    await sleep(50);
    extra.closeSSEStream?.();
    await sleep(200);
    return text('Answered on the resumed stream.');
  },
  json_schema_2020_12_tool: async (args) => text(`Got ${JSON.stringify(args)}`),
};

const resources = [
  { uri: 'test://static-text', name: 'static-text', description: 'Static text', mimeType: 'text/plain' },
  { uri: 'test://static-binary', name: 'static-binary', description: 'Static binary', mimeType: 'image/png' },
  { uri: 'test://watched-resource', name: 'watched-resource', description: 'Subscribable', mimeType: 'text/plain' },
];

function read(uri) {
  if (uri === 'test://static-binary') return { uri, mimeType: 'image/png', blob: PNG };
  const templated = /^test:\/\/template\/([^/]+)\/data$/.exec(uri);
  if (templated) return { uri, mimeType: 'application/json', text: JSON.stringify({ id: templated[1] }) };
  if (uri === 'test://static-text' || uri === 'test://watched-resource') {
    return { uri, mimeType: 'text/plain', text: 'This is the content of a static text resource.' };
  }
  throw new Error(`no resource ${uri}`);
}

const prompts = [
  { name: 'test_simple_prompt', description: 'A simple prompt' },
  { name: 'test_prompt_with_arguments', description: 'A prompt with arguments', arguments: [{ name: 'arg1', required: true }, { name: 'arg2', required: true }] },
  { name: 'test_prompt_with_embedded_resource', description: 'A prompt with a resource', arguments: [{ name: 'resourceUri', required: true }] },
  { name: 'test_prompt_with_image', description: 'A prompt with an image' },
];

function prompt(name, args = {}) {
  const user = (content) => ({ messages: [{ role: 'user', content }] });
  switch (name) {
    case 'test_simple_prompt':
      return user({ type: 'text', text: 'This is a simple prompt for testing.' });
    case 'test_prompt_with_arguments':
      return user({ type: 'text', text: `Prompt with arguments: arg1='${args.arg1}', arg2='${args.arg2}'` });
    case 'test_prompt_with_embedded_resource':
      return user({ type: 'resource', resource: { uri: args.resourceUri, mimeType: 'text/plain', text: 'Embedded resource content.' } });
    case 'test_prompt_with_image':
      return user({ type: 'image', data: PNG, mimeType: 'image/png' });
    default:
      throw new Error(`no prompt ${name}`);
  }
}

function serverFor() {
  const server = new Server(
    { name: 'idemproxy-conformance-reference', version: '1.0.0' },
    { capabilities: { tools: {}, resources: { subscribe: true }, prompts: {}, logging: {}, completions: {} } },
  );
  server.setRequestHandler(ListToolsRequestSchema, async () => ({ tools }));
  server.setRequestHandler(CallToolRequestSchema, async (req, extra) => {
    const call = calls[req.params.name];
    if (!call) throw new Error(`no tool ${req.params.name}`);
    return call(req.params.arguments ?? {}, extra, server);
  });
  server.setRequestHandler(ListResourcesRequestSchema, async () => ({ resources }));
  server.setRequestHandler(ListResourceTemplatesRequestSchema, async () => ({
    resourceTemplates: [{ uriTemplate: 'test://template/{id}/data', name: 'template', description: 'Templated', mimeType: 'application/json' }],
  }));
  server.setRequestHandler(ReadResourceRequestSchema, async (req) => ({ contents: [read(req.params.uri)] }));
  server.setRequestHandler(SubscribeRequestSchema, async () => ({}));
  server.setRequestHandler(UnsubscribeRequestSchema, async () => ({}));
  server.setRequestHandler(ListPromptsRequestSchema, async () => ({ prompts }));
  server.setRequestHandler(GetPromptRequestSchema, async (req) => prompt(req.params.name, req.params.arguments));
  server.setRequestHandler(CompleteRequestSchema, async () => ({ completion: { values: [], total: 0, hasMore: false } }));
  return server;
}

const app = createMcpExpressApp({ host: '127.0.0.1' });
const sessions = new Map();

app.post('/mcp', async (req, res) => {
  const id = req.headers['mcp-session-id'];
  let transport = id ? sessions.get(id) : undefined;
  if (!transport) {
    if (id || !isInitializeRequest(req.body)) {
      res.status(id ? 404 : 400).json({ jsonrpc: '2.0', error: { code: -32000, message: 'no such session' }, id: null });
      return;
    }
    transport = new StreamableHTTPServerTransport({
      sessionIdGenerator: () => randomUUID(),
      eventStore: new InMemoryEventStore(),
      retryInterval: 500,
      onsessioninitialized: (sid) => sessions.set(sid, transport),
    });
    transport.onclose = () => transport.sessionId && sessions.delete(transport.sessionId);
    await serverFor().connect(transport);
  }
  await transport.handleRequest(req, res, req.body);
});

const existing = async (req, res) => {
  const transport = sessions.get(req.headers['mcp-session-id']);
  if (!transport) {
    res.status(404).send('no such session');
    return;
  }
  await transport.handleRequest(req, res);
};
app.get('/mcp', existing);
app.delete('/mcp', existing);

app.listen(port, '127.0.0.1', () => console.log(`listening on ${port}`));
