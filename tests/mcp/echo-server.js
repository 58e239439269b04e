// A minimal MCP stdio server without dependencies, for tests: newline-
// delimited JSON-RPC on stdin/stdout, two tools:
//   echo  {text}     answers with the text;
//   sleep {seconds}  answers after that many seconds.
// Tests run it in a sandbox as `exec node -e "$SERVER_JS"`, the script in
// the server's environment (tests/it/mcp_gateway.rs).
'use strict';

const readline = require('readline');

const TOOLS = [
  {
    name: 'echo',
    description: 'Answer with the text given.',
    inputSchema: {
      type: 'object',
      properties: { text: { type: 'string' } },
      required: ['text'],
    },
  },
  {
    name: 'sleep',
    description: 'Wait this many seconds, then answer.',
    inputSchema: {
      type: 'object',
      properties: { seconds: { type: 'number' } },
      required: ['seconds'],
    },
  },
];

function send(message) {
  process.stdout.write(JSON.stringify(message) + '\n');
}

function text(t) {
  return { content: [{ type: 'text', text: t }] };
}

function handle(msg) {
  // Notifications (no id) need no answer.
  if (msg.id === undefined || msg.id === null) return;
  const reply = (result) => send({ jsonrpc: '2.0', id: msg.id, result });
  const fail = (code, message) =>
    send({ jsonrpc: '2.0', id: msg.id, error: { code, message } });
  const params = msg.params || {};
  switch (msg.method) {
    case 'initialize':
      return reply({
        protocolVersion: params.protocolVersion || '2025-06-18',
        capabilities: { tools: {} },
        serverInfo: { name: 'echo-server', version: '1.0.0' },
      });
    case 'ping':
      return reply({});
    case 'tools/list':
      return reply({ tools: TOOLS });
    case 'tools/call': {
      const args = params.arguments || {};
      if (params.name === 'echo') {
        return reply(text(String(args.text)));
      }
      if (params.name === 'sleep') {
        const s = Number(args.seconds) || 0;
        setTimeout(() => reply(text(`slept ${s} s`)), s * 1000);
        return undefined;
      }
      return fail(-32602, `unknown tool: ${params.name}`);
    }
    default:
      return fail(-32601, `method not found: ${msg.method}`);
  }
}

readline.createInterface({ input: process.stdin }).on('line', (line) => {
  let msg;
  try {
    msg = JSON.parse(line);
  } catch (e) {
    send({ jsonrpc: '2.0', id: null, error: { code: -32700, message: 'parse error' } });
    return;
  }
  handle(msg);
}).on('close', () => process.exit(0));

process.stderr.write('echo-server: ready\n');
