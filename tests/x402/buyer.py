"""One purchase with the official x402 Python client, in a process of its own, as an agent
makes it: GET URL, paying the seller's 402 with a fixed test key. Prints one JSON line:
{"status", "body", "payment_response", "error"}.

Usage: python buyer.py httpx|requests URL   (HTTPS_PROXY / HTTP_PROXY are honoured)
"""

import asyncio
import base64
import json
import sys

from eth_account import Account

from x402 import x402Client, x402ClientSync
from x402.mechanisms.evm import EthAccountSigner
from x402.mechanisms.evm.exact.register import register_exact_evm_client

# The client's own stateless per-payment maximum ($1 by default) is switched off: these tests
# are about the proxy's caps, which must hold whatever the client allows.
# A throwaway key: it holds nothing on any chain.
KEY = "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"


def said(status, text, headers):
    pr = headers.get("payment-response")
    decoded = json.loads(base64.b64decode(pr)) if pr else None
    return {"status": status, "body": text, "payment_response": decoded, "raw_payment_response": pr}


async def with_httpx(url):
    from x402.http.clients import x402HttpxClient

    client = x402Client()
    client.set_spend_controls(False)
    register_exact_evm_client(client, EthAccountSigner(Account.from_key(KEY)))
    async with x402HttpxClient(client, timeout=30) as http:
        r = await http.get(url)
        return said(r.status_code, r.text, r.headers)


def with_requests(url):
    from x402.http.clients import x402_requests

    client = x402ClientSync()
    client.set_spend_controls(False)
    register_exact_evm_client(client, EthAccountSigner(Account.from_key(KEY)))
    session = x402_requests(client)
    r = session.get(url, timeout=30)
    return said(r.status_code, r.text, r.headers)


if __name__ == "__main__":
    how, url = sys.argv[1], sys.argv[2]
    try:
        out = asyncio.run(with_httpx(url)) if how == "httpx" else with_requests(url)
    except Exception as e:  # the client library's own error, reported as the agent sees it
        out = {"status": None, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))
