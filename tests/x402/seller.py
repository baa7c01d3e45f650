"""A seller for the x402 tests, built with the x402 SDK's own FastAPI payment middleware:
GET /weather costs $0.01 in USDC on Base Sepolia (eip155:84532), paid to SELLER, verified
and settled through the facilitator at FACILITATOR_URL (timeout 2 s). GET /decline answers
402 the way Stripe answers a card decline (no x402 challenge). GET /count says how many
paid answers the handler produced, and how many requests arrived.

Test controls: POST /fault {"cut": true} cuts the next paid answer's connection after the
payment settled (headers sent, half the body, then the connection closes); {"stall": true}
holds the next settled answer 20 s.

Usage: python seller.py PORT FACILITATOR_URL
"""

import asyncio
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from x402 import x402ResourceServer
from x402.http import FacilitatorConfig, HTTPFacilitatorClient
from x402.http.middleware.fastapi import payment_middleware
from x402.mechanisms.evm.exact import register_exact_evm_server

SELLER = "0x209693Bc6afc0C5328bA36FaF03C514EF312287C"
NETWORK = "eip155:84532"

port, facilitator_url = int(sys.argv[1]), sys.argv[2]
facilitator = HTTPFacilitatorClient(FacilitatorConfig(url=facilitator_url, timeout=2.0))
server = x402ResourceServer(facilitator)
register_exact_evm_server(server, NETWORK)
routes = {
    "GET /weather": {
        "accepts": {"scheme": "exact", "payTo": SELLER, "price": "$0.01", "network": NETWORK},
        "description": "the weather",
    },
    "GET /dear": {
        "accepts": {"scheme": "exact", "payTo": SELLER, "price": "$7.00", "network": NETWORK},
        "description": "expensive weather",
    },
}
app = FastAPI()
served = {"n": 0, "requests": 0}
fault = {"cut": False, "stall": False}
x402 = payment_middleware(routes, server)


@app.middleware("http")
async def pay(request: Request, call_next):
    if request.url.path not in ("/count", "/fault"):
        served["requests"] += 1
    return await x402(request, call_next)


@app.get("/weather")
async def weather():
    served["n"] += 1
    return {"weather": "sunny", "served": served["n"]}


@app.get("/dear")
async def dear():
    served["n"] += 1
    return {"weather": "golden", "served": served["n"]}


@app.get("/decline")
async def decline():
    return JSONResponse(
        {"error": {"type": "card_error", "code": "card_declined", "message": "Your card was declined."}},
        status_code=402,
    )


@app.get("/count")
async def count():
    return {"served": served["n"], "requests": served["requests"]}


@app.post("/fault")
async def set_fault(request: Request):
    fault.update(await request.json())
    return {"ok": True}


def cutting(inner):
    """When told to, once: cuts a settled answer's connection (the seller was paid, the
    buyer never hears it), or stalls it 20 s after settling (the buyer's side may die
    meanwhile)."""

    async def asgi(scope, receive, send):
        mode = "cut" if fault["cut"] else "stall" if fault["stall"] else None
        if scope["type"] != "http" or mode is None:
            return await inner(scope, receive, send)
        settled = {"yes": False}

        async def faulty_send(message):
            if message["type"] == "http.response.start":
                settled["yes"] = any(k.lower() == b"payment-response" for k, _ in message["headers"])
                if settled["yes"]:
                    fault[mode] = False
                    if mode == "stall":
                        await asyncio.sleep(20)
            if message["type"] == "http.response.body" and settled["yes"] and mode == "cut":
                body = message.get("body", b"")
                await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
                raise RuntimeError("connection cut after settlement (test fault)")
            await send(message)

        return await inner(scope, receive, faulty_send)

    return asgi


if __name__ == "__main__":
    uvicorn.run(cutting(app), host="127.0.0.1", port=port, log_level="warning")
