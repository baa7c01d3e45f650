"""An MCP tool server (stdio) whose tool pays an invoice with the official stripe SDK, default
settings. Nothing here names the proxy or its CA. An agent framework starts it as a child
process: CrewAI's MCP stdio transport gives it only HOME, LOGNAME, PATH, SHELL, TERM and USER
(mcp.client.stdio.get_default_environment()), plus STRIPE_API_KEY here."""
import os

import stripe
from mcp.server.fastmcp import FastMCP

server = FastMCP("payments")


@server.tool()
def pay_invoice(invoice: str, amount: int) -> dict:
    """Pays one invoice with a PaymentIntent."""
    stripe.api_key = os.environ["STRIPE_API_KEY"]
    try:
        pi = stripe.PaymentIntent.create(
            amount=amount,
            currency="usd",
            payment_method="pm_card_visa",
            confirm=True,
            metadata={"invoice_id": invoice},
        )
        return {"payment_intent": pi.id, "status": pi.status}
    except stripe.StripeError as e:
        return {"error": type(e).__name__, "message": str(e)[:300]}


if __name__ == "__main__":
    server.run("stdio")
