"""One call of a provider's official Python SDK as a tool makes it: default settings, no
argument beyond what the operation needs (no Tag, no custom_args, no idempotency key, no
client order id unless given), credentials from the usual environment variables. Nothing here
names the proxy or its CA: the worker's environment does (tests/it/sdk_examples.rs). One
invocation is one run of a tool.

    sdk_examples.py postmark  TO SUBJECT [TAG]      postmarker ServerClient.emails.send
    sdk_examples.py sendgrid  TO SUBJECT [CAMPAIGN]  sendgrid SendGridAPIClient.send(Mail)
    sdk_examples.py mailgun   TO SUBJECT            mailgun Client.messages.create
    sdk_examples.py resend    TO SUBJECT            resend.Emails.send
    sdk_examples.py ses       TO SUBJECT            boto3 sesv2 send_email
    sdk_examples.py twilio    TO BODY               twilio messages.create
    sdk_examples.py stripe    AMOUNT [INVOICE]      stripe.PaymentIntent.create (confirmed)
    sdk_examples.py alpaca    SYMBOL [CLIENT_ORDER_ID]  alpaca-py TradingClient.submit_order

Prints one JSON line: the id the provider gave (and whether the proxy replayed it, where the
SDK exposes headers), or {"error"} with what the SDK raised.
"""
import json
import os
import sys

TEXT = "Your invoice is attached."


def postmark(to, subject, tag=None):
    from postmarker.core import PostmarkClient

    client = PostmarkClient(server_token=os.environ["POSTMARK_SERVER_TOKEN"])
    args = dict(From="agent@example.com", To=to, Subject=subject, HtmlBody=f"<p>{TEXT}</p>")
    if tag:
        args["Tag"] = tag
    r = client.emails.send(**args)
    return {"id": r["MessageID"]}


def sendgrid(to, subject, campaign=None):
    from sendgrid import SendGridAPIClient
    from sendgrid.helpers.mail import CustomArg, Mail

    message = Mail(from_email="agent@example.com", to_emails=to, subject=subject, plain_text_content=TEXT)
    if campaign:
        message.custom_arg = CustomArg("campaign_id", campaign)
    r = SendGridAPIClient(os.environ["SENDGRID_API_KEY"]).send(message)
    return {"id": r.headers.get("X-Message-Id"), "status": r.status_code, "replayed": r.headers.get("Idempotent-Replayed")}


def mailgun(to, subject):
    from mailgun.client import Client

    client = Client(auth=("api", os.environ["MAILGUN_API_KEY"]))
    r = client.messages.create(
        data={"from": "agent@mg.example.com", "to": to, "subject": subject, "text": TEXT},
        domain="mg.example.com",
    )
    if r.status_code >= 400:
        return {"error": f"HTTP {r.status_code}", "message": r.text[:300]}
    return {"id": r.json()["id"], "replayed": r.headers.get("Idempotent-Replayed")}


def resend(to, subject):
    import resend as sdk

    sdk.api_key = os.environ["RESEND_API_KEY"]
    r = sdk.Emails.send({"from": "agent@example.com", "to": [to], "subject": subject, "text": TEXT})
    return {"id": r["id"]}


def ses(to, subject):
    import boto3

    r = boto3.client("sesv2").send_email(
        FromEmailAddress="agent@example.com",
        Destination={"ToAddresses": [to]},
        Content={"Simple": {"Subject": {"Data": subject}, "Body": {"Text": {"Data": TEXT}}}},
    )
    return {"id": r["MessageId"], "replayed": r["ResponseMetadata"]["HTTPHeaders"].get("idempotent-replayed")}


def twilio(to, body):
    from twilio.rest import Client

    message = Client().messages.create(to=to, from_="+15005550006", body=body)
    return {"id": message.sid}


def stripe(amount, invoice=None):
    import stripe as sdk

    sdk.api_key = os.environ["STRIPE_API_KEY"]
    args = dict(amount=int(amount), currency="usd", payment_method="pm_card_visa", confirm=True)
    if invoice:
        args["metadata"] = {"invoice_id": invoice}
    intent = sdk.PaymentIntent.create(**args)
    return {"id": intent.id, "status": intent.status}


def alpaca(symbol, client_order_id=None):
    from alpaca.trading.client import TradingClient
    from alpaca.trading.enums import OrderSide, TimeInForce
    from alpaca.trading.requests import MarketOrderRequest

    client = TradingClient(os.environ["APCA_API_KEY_ID"], os.environ["APCA_API_SECRET_KEY"], paper=True)
    args = dict(symbol=symbol, qty=1, side=OrderSide.BUY, time_in_force=TimeInForce.DAY)
    if client_order_id:
        args["client_order_id"] = client_order_id
    order = client.submit_order(MarketOrderRequest(**args))
    return {"id": str(order.id), "client_order_id": order.client_order_id}


TOOLS = {
    "postmark": postmark,
    "sendgrid": sendgrid,
    "mailgun": mailgun,
    "resend": resend,
    "ses": ses,
    "twilio": twilio,
    "stripe": stripe,
    "alpaca": alpaca,
}


def main(argv):
    try:
        out = TOOLS[argv[1]](*argv[2:])
    except Exception as e:  # what the agent would see
        out = {"error": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)[:400]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
