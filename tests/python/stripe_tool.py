"""An agent's payment tool, written the way tools use the official Stripe SDK: module-level
configuration, default settings (the SDK's own network retries on), no idempotency key. One
invocation of this script is one run of the tool; a re-run is a new process.

    stripe_tool.py charge  INVOICE AMOUNT DESCRIPTION [SOURCE]
    stripe_tool.py flow    EMAIL INVOICE AMOUNT
    stripe_tool.py pay     INVOICE AMOUNT          (one PaymentIntent, confirmed at creation)
    stripe_tool.py pay-client INVOICE AMOUNT       (the same with StripeClient, the newer style)

Prints one JSON line: the objects' ids, or the error the SDK raised (what the agent would see).
"""
import json
import os
import sys

import stripe

stripe.api_key = os.environ["STRIPE_API_KEY"]
if os.environ.get("STRIPE_API_BASE"):
    stripe.api_base = os.environ["STRIPE_API_BASE"]


def error(e):
    return {
        "error": type(e).__name__,
        "http_status": getattr(e, "http_status", None),
        "code": getattr(e, "code", None),
        "message": str(e)[:300],
    }


def charge(invoice, amount, description, source="tok_visa"):
    ch = stripe.Charge.create(
        amount=amount,
        currency="usd",
        source=source,
        description=description,
        metadata={"invoice_id": invoice},
    )
    return {"charge": ch.id, "status": ch.status}


def flow(email, invoice, amount):
    customer = stripe.Customer.create(email=email, description="agent-created customer")
    pi = stripe.PaymentIntent.create(
        amount=amount,
        currency="usd",
        customer=customer.id,
        metadata={"invoice_id": invoice},
    )
    confirmed = stripe.PaymentIntent.confirm(pi.id, payment_method="pm_card_visa")
    refund = stripe.Refund.create(payment_intent=pi.id, amount=int(amount) // 2)
    return {
        "customer": customer.id,
        "payment_intent": pi.id,
        "status": confirmed.status,
        "refund": refund.id,
    }


def pay(invoice, amount):
    pi = stripe.PaymentIntent.create(
        amount=amount,
        currency="usd",
        payment_method="pm_card_visa",
        confirm=True,
        metadata={"invoice_id": invoice},
    )
    return {"payment_intent": pi.id, "status": pi.status}


def pay_client(invoice, amount):
    client = stripe.StripeClient(os.environ["STRIPE_API_KEY"])
    pi = client.v1.payment_intents.create(
        params={
            "amount": int(amount),
            "currency": "usd",
            "payment_method": "pm_card_visa",
            "confirm": True,
            "metadata": {"invoice_id": invoice},
        }
    )
    return {"payment_intent": pi.id, "status": pi.status}


def main(argv):
    command, args = argv[1], argv[2:]
    try:
        if command == "charge":
            out = charge(args[0], args[1], args[2], *args[3:4])
        elif command == "flow":
            out = flow(args[0], args[1], args[2])
        elif command == "pay":
            out = pay(args[0], args[1])
        elif command == "pay-client":
            out = pay_client(args[0], args[1])
        else:
            raise SystemExit(f"unknown command {command}")
    except stripe.StripeError as e:
        out = error(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
