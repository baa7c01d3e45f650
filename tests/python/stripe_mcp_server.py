"""A stand-in for Stripe's remote MCP server (https://mcp.stripe.com), built with the official
SDK (FastMCP, mcp 1.x) over Streamable HTTP and TLS at the server's root path. It serves the
tool names and argument shapes of Stripe's agent toolkit (the tools the remote server serves)
and keeps Stripe's objects in memory: ids are minted per created object, finalizing an invoice
twice fails as Stripe does ("already finalized"). Every executed write appends one JSON line
to the effects file. Started by tests/it/mcp_stripe.rs."""
import argparse
import json

import uvicorn
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import ToolAnnotations

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--cert", required=True)
parser.add_argument("--key", required=True)
parser.add_argument("--effects", required=True)
parser.add_argument("--json", action="store_true")
opts = parser.parse_args()

# The Host header is the public name the client dialled through the proxy.
security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
server = FastMCP(
    "stripe",
    json_response=opts.json,
    log_level="WARNING",
    transport_security=security,
    streamable_http_path="/",
)

objects = {}  # id -> object
counters = {}
READ = ToolAnnotations(readOnlyHint=True)
WRITE = ToolAnnotations(readOnlyHint=False, idempotentHint=False, destructiveHint=False)


def create(prefix: str, tool: str, args: dict, **fields) -> dict:
    counters[prefix] = counters.get(prefix, 0) + 1
    obj = {"id": f"{prefix}_{counters[prefix]}", **fields}
    objects[obj["id"]] = obj
    with open(opts.effects, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "id": obj["id"]}) + "\n")
    return obj


@server.tool(annotations=WRITE)
def create_customer(name: str, email: str | None = None) -> dict:
    """Creates a customer."""
    c = create("cus", "create_customer", {"name": name, "email": email}, name=name, email=email)
    return {"id": c["id"]}


@server.tool(annotations=WRITE)
def create_product(name: str, description: str | None = None) -> dict:
    """Creates a product."""
    args = {"name": name, "description": description}
    return create("prod", "create_product", args, name=name, description=description)


@server.tool(annotations=WRITE)
def create_price(product: str, unit_amount: int, currency: str) -> dict:
    """Creates a price for a product, in cents."""
    args = {"product": product, "unit_amount": unit_amount, "currency": currency}
    return create("price", "create_price", args, **args)


@server.tool(annotations=WRITE)
def create_payment_link(price: str, quantity: int, redirect_url: str | None = None) -> dict:
    """Creates a payment link for a price."""
    args = {"price": price, "quantity": quantity, "redirect_url": redirect_url}
    link = create("plink", "create_payment_link", args, **args)
    return {"id": link["id"], "url": f"https://buy.stripe.com/test_{link['id']}"}


@server.tool(annotations=WRITE)
def create_invoice(customer: str, days_until_due: int | None = None) -> dict:
    """Creates a draft invoice for a customer."""
    args = {"customer": customer, "days_until_due": days_until_due}
    inv = create("in", "create_invoice", args, customer=customer, status="draft")
    return {"id": inv["id"], "status": inv["status"]}


@server.tool(annotations=WRITE)
def create_invoice_item(customer: str, price: str, invoice: str) -> dict:
    """Adds a line to an invoice."""
    args = {"customer": customer, "price": price, "invoice": invoice}
    item = create("ii", "create_invoice_item", args, **args)
    return {"id": item["id"], "invoice": invoice}


@server.tool(annotations=WRITE)
def finalize_invoice(invoice: str) -> dict:
    """Finalizes a draft invoice (with automatic collection, the customer is charged)."""
    inv = objects.get(invoice)
    if inv is None:
        raise ValueError(f"No such invoice: '{invoice}'")
    if inv["status"] != "draft":
        raise ValueError("This invoice is already finalized, you can't re-finalize a non-draft invoice.")
    inv["status"] = "open"
    with open(opts.effects, "a") as f:
        f.write(json.dumps({"tool": "finalize_invoice", "args": {"invoice": invoice}}) + "\n")
    return {"id": invoice, "status": "open", "hosted_invoice_url": f"https://invoice.stripe.com/i/{invoice}"}


@server.tool(annotations=WRITE)
def create_refund(payment_intent: str, amount: int | None = None) -> dict:
    """Refunds a payment intent (the whole of it without an amount)."""
    args = {"payment_intent": payment_intent, "amount": amount}
    re = create("re", "create_refund", args, status="succeeded", amount=amount)
    return {"id": re["id"], "status": "succeeded", "amount": amount}


@server.tool(annotations=READ)
def list_products(limit: int = 10) -> dict:
    """Lists products."""
    return {"data": [o for o in objects.values() if o["id"].startswith("prod_")][:limit]}


@server.tool(annotations=READ)
def retrieve_balance() -> dict:
    """Reads the balance: changes nothing."""
    refunded = sum(o.get("amount") or 0 for o in objects.values() if o["id"].startswith("re_"))
    return {"available": [{"amount": 100000 - refunded, "currency": "usd"}]}


uvicorn.run(
    server.streamable_http_app(),
    host="127.0.0.1",
    port=opts.port,
    ssl_certfile=opts.cert,
    ssl_keyfile=opts.key,
    log_level="warning",
)
