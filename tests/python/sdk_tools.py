"""Agent tools written with the providers' official Python SDKs, default settings, credentials
from the usual environment variables. Nothing here names the proxy or its CA: the worker's
environment does (tests/it/sdk_matrix.rs). One invocation is one run of a tool.

    sdk_tools.py ses      TO SUBJECT         boto3 sesv2 send_email
    sdk_tools.py twilio   TO BODY            twilio messages.create
    sdk_tools.py sendgrid TO SUBJECT CAMPAIGN sendgrid send(Mail)
    sdk_tools.py alpaca   CLIENT_ORDER_ID    alpaca-py TradingClient(paper=True).submit_order

Prints one JSON line: what the SDK returned, or {"error"} with what it raised.
"""
import json
import os
import sys


def ses(to, subject):
    import boto3

    r = boto3.client("sesv2").send_email(
        FromEmailAddress="agent@example.com",
        Destination={"ToAddresses": [to]},
        Content={
            "Simple": {
                "Subject": {"Data": subject},
                "Body": {"Text": {"Data": "Your invoice is attached."}},
            }
        },
    )
    return {"id": r["MessageId"], "replayed": r["ResponseMetadata"]["HTTPHeaders"].get("idempotent-replayed")}


def twilio(to, body):
    from twilio.rest import Client

    message = Client().messages.create(to=to, from_="+15005550006", body=body)
    return {"id": message.sid, "status": message.status}


def sendgrid(to, subject, campaign):
    from sendgrid import SendGridAPIClient
    from sendgrid.helpers.mail import CustomArg, Mail

    message = Mail(
        from_email="agent@example.com",
        to_emails=to,
        subject=subject,
        plain_text_content="Your invoice is attached.",
    )
    message.custom_arg = CustomArg("campaign_id", campaign)
    r = SendGridAPIClient(os.environ["SENDGRID_API_KEY"]).send(message)
    return {
        "status": r.status_code,
        "id": json.loads(r.body).get("id"),
        "replayed": r.headers.get("Idempotent-Replayed"),
    }


def alpaca(client_order_id):
    from alpaca.trading.client import TradingClient
    from alpaca.trading.enums import OrderSide, TimeInForce
    from alpaca.trading.requests import MarketOrderRequest

    client = TradingClient(os.environ["APCA_API_KEY_ID"], os.environ["APCA_API_SECRET_KEY"], paper=True)
    order = client.submit_order(
        MarketOrderRequest(
            symbol="AAPL",
            qty=1,
            side=OrderSide.BUY,
            time_in_force=TimeInForce.DAY,
            client_order_id=client_order_id,
        )
    )
    return {"id": str(order.id), "client_order_id": order.client_order_id}


TOOLS = {"ses": ses, "twilio": twilio, "sendgrid": sendgrid, "alpaca": alpaca}


def main(argv):
    try:
        out = TOOLS[argv[1]](*argv[2:])
    except Exception as e:  # what the agent would see
        out = {"error": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)[:300]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
