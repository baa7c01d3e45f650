"""A payment tool written with a plain HTTP client, as tools are: it POSTs Stripe's
PaymentIntents endpoint with the secret key from STRIPE_API_KEY, nothing else. Nothing here
names the proxy or its CA: the worker's environment does (tests/it/sdk_matrix.rs). One
invocation is one run of the tool; a re-run is a new process.

    http_tool.py CLIENT INVOICE AMOUNT
    CLIENT: requests | httpx | httpx-async | aiohttp | urllib

Prints one JSON line: {"status", "id", "replayed"}, or {"error"} with what the client raised.
"""
import json
import os
import sys
import urllib.parse

URL = "https://api.stripe.com/v1/payment_intents"


def request_parts(invoice, amount):
    body = urllib.parse.urlencode(
        {
            "amount": amount,
            "currency": "usd",
            "payment_method": "pm_card_visa",
            "confirm": "true",
            "metadata[invoice_id]": invoice,
        }
    )
    headers = {
        "Authorization": f"Bearer {os.environ['STRIPE_API_KEY']}",
        "Content-Type": "application/x-www-form-urlencoded",
    }
    return body, headers


def with_requests(body, headers):
    import requests

    r = requests.post(URL, data=body, headers=headers, timeout=20)
    return r.status_code, r.headers, r.content


def with_httpx(body, headers):
    import httpx

    r = httpx.post(URL, content=body, headers=headers, timeout=20)
    return r.status_code, r.headers, r.content


def with_httpx_async(body, headers):
    import asyncio

    import httpx

    async def run():
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(URL, content=body, headers=headers)
            return r.status_code, r.headers, r.content

    return asyncio.run(run())


def with_aiohttp(body, headers):
    import asyncio

    import aiohttp

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            async with session.post(URL, data=body, headers=headers) as r:
                return r.status, r.headers, await r.read()

    return asyncio.run(run())


def with_urllib(body, headers):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(URL, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


CLIENTS = {
    "requests": with_requests,
    "httpx": with_httpx,
    "httpx-async": with_httpx_async,
    "aiohttp": with_aiohttp,
    "urllib": with_urllib,
}


def main(argv):
    client, invoice, amount = argv[1], argv[2], argv[3]
    body, headers = request_parts(invoice, amount)
    try:
        status, response_headers, content = CLIENTS[client](body, headers)
        payload = json.loads(content)
        out = {
            "status": status,
            "id": payload.get("id"),
            "replayed": response_headers.get("Idempotent-Replayed"),
        }
    except Exception as e:  # what the agent would see
        out = {"error": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)[:300]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
