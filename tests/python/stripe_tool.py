"""An agent's payment tool, written the way tools use the official Stripe SDK: module-level
configuration, default settings (the SDK's own network retries on), no idempotency key. One
invocation of this script is one run of the tool; a re-run is a new process.

    stripe_tool.py charge  INVOICE AMOUNT DESCRIPTION [SOURCE]
    stripe_tool.py flow    EMAIL INVOICE AMOUNT
    stripe_tool.py pay     INVOICE AMOUNT          (one PaymentIntent, confirmed at creation)
    stripe_tool.py capture-flow INVOICE AMOUNT     (create, confirm, capture: manual capture)
    stripe_tool.py pay-client INVOICE AMOUNT       (the same with StripeClient, the newer style)
    stripe_tool.py charge-no-invoice AMOUNT        (a charge that names no invoice)
    stripe_tool.py charge-keyed KEY AMOUNT         (a charge under the tool's own idempotency key)

Prints one JSON line: the objects' ids, or the error the SDK raised (what the agent would see:
its class, status, Stripe error type and code, and message), and `seconds`: how long the SDK
call took, its own retries included.
"""
import json
import os
import sys
import time

import stripe

stripe.api_key = os.environ["STRIPE_API_KEY"]
if os.environ.get("STRIPE_API_BASE"):
    stripe.api_base = os.environ["STRIPE_API_BASE"]


def error(e):
    # stripe-python sets `code` on the exception for some classes only (InvalidRequestError,
    # CardError); every StripeError parsed from Stripe's error shape carries it in `error`.
    parsed = getattr(e, "error", None)
    return {
        "error": type(e).__name__,
        "http_status": getattr(e, "http_status", None),
        "type": getattr(parsed, "type", None),
        "code": getattr(e, "code", None) or getattr(parsed, "code", None),
        "message": getattr(e, "user_message", None) or str(e),
    }


def charge(invoice, amount, description, source="tok_visa"):
    ch = stripe.Charge.create(
        amount=amount,
        currency="usd",
        source=source,
        description=description,
        metadata={"invoice_id": invoice},
    )
    return {"charge": ch.id, "status": getattr(ch, "status", None)}


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


def capture_flow(invoice, amount):
    """Stripe's two-step flow: authorise (create, confirm), then capture."""
    pi = stripe.PaymentIntent.create(
        amount=amount,
        currency="usd",
        capture_method="manual",
        metadata={"invoice_id": invoice},
    )
    confirmed = stripe.PaymentIntent.confirm(pi.id, payment_method="pm_card_visa")
    captured = stripe.PaymentIntent.capture(pi.id)
    return {
        "payment_intent": pi.id,
        "confirmed": confirmed.status,
        "status": captured.status,
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


def charge_no_invoice(amount):
    ch = stripe.Charge.create(amount=amount, currency="usd", source="tok_visa")
    return {"charge": ch.id, "status": getattr(ch, "status", None)}


def charge_keyed(key, amount):
    ch = stripe.Charge.create(
        amount=amount, currency="usd", source="tok_visa", idempotency_key=key
    )
    return {"charge": ch.id, "status": getattr(ch, "status", None)}


def main(argv):
    command, args = argv[1], argv[2:]
    started = time.monotonic()
    try:
        if command == "charge":
            out = charge(args[0], args[1], args[2], *args[3:4])
        elif command == "flow":
            out = flow(args[0], args[1], args[2])
        elif command == "capture-flow":
            out = capture_flow(args[0], args[1])
        elif command == "pay":
            out = pay(args[0], args[1])
        elif command == "pay-client":
            out = pay_client(args[0], args[1])
        elif command == "charge-no-invoice":
            out = charge_no_invoice(args[0])
        elif command == "charge-keyed":
            out = charge_keyed(args[0], args[1])
        else:
            raise SystemExit(f"unknown command {command}")
    except stripe.StripeError as e:
        out = error(e)
    out["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
