"""A facilitator stand-in for the x402 tests: a real HTTP server (the facilitator API the
x402 SDK's HTTPFacilitatorClient speaks: /supported, /verify, /settle) running the SDK's own
x402Facilitator with its `exact` EVM scheme, so every payment is checked the SDK's way
(EIP-712 / EIP-3009 signature recovered, payee, amount, validity window). No chain: the
"token contract" is this process, which settles each authorization nonce at most once (a
second transferWithAuthorization with a used nonce reverts, as on chain) and counts what it
settled.

Test controls: GET /count -> {"settled": n, "nonces": [...], "seen": [...]} (nonces settled,
and every nonce the seller presented, in order); POST /fault {"settle": "slow"}
makes the next settle sleep past the seller's facilitator timeout without settling
("slow"), or settle and then sleep ("slow-after").

Usage: python facilitator.py PORT
"""

import asyncio
import sys
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from x402 import x402Facilitator
from x402.mechanisms.evm.exact import register_exact_evm_facilitator
from x402.mechanisms.evm.types import TransactionReceipt
from x402.schemas import PaymentRequirements, parse_payment_payload

NETWORK = "eip155:84532"
CHAIN_ID = 84532
USDC = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
FACILITATOR = "0x000000000000000000000000000000000000fac1"

lock = threading.Lock()
used = set()
settled = []
seen = []  # every nonce the seller asked to verify or settle, in order
fault = {"settle": None}


def nonce_of(args):
    # transferWithAuthorization(from, to, value, validAfter, validBefore, nonce, ...)
    n = args[5]
    return n.hex() if isinstance(n, (bytes, bytearray)) else str(n)


class Chainless:
    """The FacilitatorEvmSigner the SDK asks for chain reads and writes."""

    def get_addresses(self):
        return [FACILITATOR]

    def get_chain_id(self):
        return CHAIN_ID

    def get_code(self, address):
        # The token is a contract; every payer a plain EOA.
        return b"\x60\x80" if address.lower() == USDC.lower() else b""

    def get_balance(self, address, token_address):
        return 10**12

    def read_contract(self, address, abi, function_name, *args, **kwargs):
        if function_name == "transferWithAuthorization":
            with lock:
                if nonce_of(args) in used:
                    raise RuntimeError("FiatTokenV2: authorization is used or canceled")
            return None
        if function_name == "authorizationState":
            n = args[1]
            n = n.hex() if isinstance(n, (bytes, bytearray)) else str(n)
            with lock:
                return n in used
        if function_name == "balanceOf":
            return 10**12
        if function_name == "name":
            return "USDC"
        if function_name == "version":
            return "2"
        raise RuntimeError(f"no chain here for {function_name}")

    def write_contract(self, address, abi, function_name, *args, **kwargs):
        if function_name != "transferWithAuthorization":
            raise RuntimeError(f"no chain here for {function_name}")
        nonce = nonce_of(args)
        with lock:
            if nonce in used:
                raise RuntimeError("FiatTokenV2: authorization is used or canceled")
            used.add(nonce)
            settled.append(nonce)
            return "0x" + format(len(settled), "064x")

    def send_transaction(self, to, data):
        raise RuntimeError("no chain here")

    def wait_for_transaction_receipt(self, tx_hash):
        return TransactionReceipt(status=1, block_number=1, tx_hash=tx_hash)


facilitator = x402Facilitator()
register_exact_evm_facilitator(facilitator, Chainless(), networks=NETWORK)
app = FastAPI()


def dump(model):
    return model.model_dump(by_alias=True, exclude_none=True)


def note_seen(body):
    nonce = body["paymentPayload"].get("payload", {}).get("authorization", {}).get("nonce", "")
    with lock:
        if nonce.lower().removeprefix("0x") not in seen:
            seen.append(nonce.lower().removeprefix("0x"))


@app.get("/supported")
async def supported():
    return dump(facilitator.get_supported())


@app.post("/verify")
async def verify(request: Request):
    body = await request.json()
    payload = parse_payment_payload(body["paymentPayload"])
    requirements = PaymentRequirements.model_validate(body["paymentRequirements"])
    note_seen(body)
    return dump(await facilitator.verify(payload, requirements))


@app.post("/settle")
async def settle(request: Request):
    body = await request.json()
    payload = parse_payment_payload(body["paymentPayload"])
    requirements = PaymentRequirements.model_validate(body["paymentRequirements"])
    how, fault["settle"] = fault["settle"], None
    if how == "slow":
        await asyncio.sleep(6)
        return JSONResponse({"error": "overloaded"}, status_code=503)
    result = await facilitator.settle(payload, requirements)
    if how == "slow-after":
        await asyncio.sleep(6)
    return dump(result)


@app.get("/count")
async def count():
    with lock:
        return {"settled": len(settled), "nonces": list(settled), "seen": list(seen)}


@app.post("/fault")
async def set_fault(request: Request):
    fault.update(await request.json())
    return {"ok": True}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
