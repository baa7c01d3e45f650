'use strict';
/*
 * idemproxy's preload for Node.js workers, written by `idemproxy env` (rewritten each time: do
 * not edit). Loaded with NODE_OPTIONS=--require=<this file>; the CA comes from
 * NODE_EXTRA_CA_CERTS, which Node reads by itself. What it does, only while HTTPS_PROXY (or
 * https_proxy) is set, and nothing at all with IDEMPROXY_WORKER=off:
 *
 * 1. https.Agent: Node's https agents ignore HTTPS_PROXY, and SDKs make their own (the stripe
 *    package uses `new https.Agent({keepAlive: true})`). Every https.Agent connection to a host
 *    NO_PROXY does not name is opened through a CONNECT tunnel to HTTPS_PROXY (Basic
 *    Proxy-Authorization from its user:password), then TLS as usual. Agents that already use
 *    a proxy are left alone: axios's own HttpsProxyAgent, an `httpAgent` the program passes,
 *    and on Node >= 22.21 / 24.5 agents made with `proxyEnv` (NODE_USE_ENV_PROXY=1).
 * 2. Built-in fetch: on Node < 22.21 it ignores HTTPS_PROXY. When the program can load the
 *    `undici` package (npm install undici; resolved from the main script, then the working
 *    directory), fetch is given undici's EnvHttpProxyAgent (setGlobalDispatcher), which reads
 *    HTTPS_PROXY and NO_PROXY. Without it, the first fetch prints one warning saying so.
 */

const http = require('node:http');
const https = require('node:https');
const path = require('node:path');
const { createRequire } = require('node:module');

const PREFIX = 'idemproxy worker preload';

function proxyUrl() {
  const raw = process.env.HTTPS_PROXY || process.env.https_proxy;
  if (!raw) return null;
  try {
    const url = new URL(raw);
    return url.protocol === 'http:' ? url : null;
  } catch {
    return null;
  }
}

function unbracket(host) {
  return String(host).replace(/^\[/, '').replace(/\]$/, '').toLowerCase();
}

/** NO_PROXY: `*`, host names (a leading `.` or `*.` matches subdomains), IPs, `host:port`. */
function bypassed(host, port) {
  const list = process.env.NO_PROXY ?? process.env.no_proxy ?? '';
  const h = unbracket(host);
  return list
    .split(/[\s,]+/)
    .filter(Boolean)
    .some((raw) => {
      if (raw === '*') return true;
      let entry = raw.toLowerCase();
      let entryPort = null;
      const withPort = entry.match(/^(\[[^\]]+\]|[^:]+):(\d+)$/);
      if (withPort) {
        entry = withPort[1];
        entryPort = Number(withPort[2]);
      }
      if (entryPort !== null && entryPort !== port) return false;
      entry = unbracket(entry).replace(/^\*?\./, '');
      return h === entry || h.endsWith(`.${entry}`);
    });
}

function nodeHasEnvProxy() {
  const [major, minor] = process.versions.node.split('.').map(Number);
  return major > 24 || (major === 24 && minor >= 5) || (major === 22 && minor >= 21);
}

function patchHttpsAgent() {
  const original = https.Agent.prototype.createConnection;
  if (original.idemproxy) return;
  function createConnection(options, callback) {
    const proxy = proxyUrl();
    const ownProxy = this && this.options && this.options.proxyEnv;
    if (
      !proxy ||
      ownProxy ||
      options === null ||
      typeof options !== 'object' ||
      typeof callback !== 'function' ||
      options.socket
    ) {
      return original.apply(this, arguments);
    }
    const host = options.host || options.hostname || 'localhost';
    const port = Number(options.port) || 443;
    if (bypassed(host, port)) return original.apply(this, arguments);
    const target = `${host.includes(':') ? `[${host}]` : host}:${port}`;
    const headers = { host: target };
    if (proxy.username) {
      const user = decodeURIComponent(proxy.username);
      const pass = decodeURIComponent(proxy.password);
      headers['proxy-authorization'] = `Basic ${Buffer.from(`${user}:${pass}`).toString('base64')}`;
    }
    let settled = false;
    const settle = (err, socket) => {
      if (settled) return;
      settled = true;
      callback(err, socket);
    };
    const req = http.request({
      host: unbracket(proxy.hostname),
      port: Number(proxy.port) || 80,
      method: 'CONNECT',
      path: target,
      headers,
      agent: false,
    });
    req.once('connect', (res, socket, head) => {
      if (res.statusCode !== 200) {
        socket.destroy();
        settle(
          new Error(`${PREFIX}: the proxy ${proxy.host} answered CONNECT ${target} with ${res.statusCode} ${res.statusMessage}`),
        );
        return;
      }
      if (head && head.length) socket.unshift(head);
      try {
        settle(null, original.call(this, { ...options, socket }));
      } catch (err) {
        socket.destroy();
        settle(err);
      }
    });
    req.once('error', (err) => settle(err));
    req.end();
    return undefined;
  }
  createConnection.idemproxy = true;
  https.Agent.prototype.createConnection = createConnection;
}

function loadUndici() {
  const bases = [];
  if (process.argv[1]) bases.push(path.resolve(process.argv[1]));
  bases.push(path.join(process.cwd(), 'index.js'));
  for (const base of bases) {
    try {
      const undici = createRequire(base)('undici');
      if (typeof undici.EnvHttpProxyAgent === 'function' && typeof undici.setGlobalDispatcher === 'function') {
        return undici;
      }
    } catch {
      // not installed next to this program
    }
  }
  return null;
}

function routeFetch() {
  if (typeof globalThis.fetch !== 'function') return;
  const undici = loadUndici();
  if (undici) {
    undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
    return;
  }
  if (nodeHasEnvProxy() && process.env.NODE_USE_ENV_PROXY === '1') return;
  const fetch = globalThis.fetch;
  let warned = false;
  globalThis.fetch = function fetchWithoutProxy(...args) {
    if (!warned) {
      warned = true;
      process.emitWarning(
        `built-in fetch on Node ${process.versions.node} ignores HTTPS_PROXY: add the undici package ` +
          '(npm install undici) and this preload routes fetch through the proxy, or run Node >= 22.21 with NODE_USE_ENV_PROXY=1',
        { code: 'IDEMPROXY_FETCH_UNPROXIED' },
      );
    }
    return fetch.apply(this, args);
  };
}

if (process.env.IDEMPROXY_WORKER !== 'off' && proxyUrl()) {
  patchHttpsAgent();
  routeFetch();
}
