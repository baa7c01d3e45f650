//! What costs money at each provider: one row per money-moving request, each from the
//! provider's API reference (the URL on the row), saying how the proxy prices it. The rows
//! are a profile's default `[routes.spend]`; `docs/spend.md` lists them, and each row's
//! `example` is sent through the proxy binary by `tests/it/catalogue.rs`.

/// One money-moving request.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// `METHOD /path/*`, as in `operations`.
    pub op: &'static str,
    pub price: RowPrice,
    /// The provider's API reference for the request.
    pub source: &'static str,
    /// When the request creates an object later steps of which cost nothing more
    /// (confirming a PaymentIntent): the object's kind and where its id is in the answer.
    pub records: Option<(&'static str, &'static str)>,
    /// A request of this kind (path, JSON body) above 10.00 USD where it is priced.
    pub example: (&'static str, &'static str),
}

/// How a row is priced.
#[derive(Debug, Clone, Copy)]
pub enum RowPrice {
    /// By the profile's amount fields (`SpendDefaults::amount`).
    Body,
    /// By other fields: amount expressions, currency, unit.
    Fields(&'static [&'static str], &'static str, &'static str),
    /// A step of an object of this kind the proxy counted at its creation (its id is path
    /// segment `.1`, from 0): free then; unpriced for an object it did not count.
    Counted(&'static str, usize),
    /// Free unless the body sets one of these fields; then unpriced (why).
    UnpricedIf(&'static [&'static str], &'static str),
    /// Moves money the request does not say how much of (why).
    Unpriced(&'static str),
}

const fn row(
    op: &'static str,
    price: RowPrice,
    source: &'static str,
    example: (&'static str, &'static str),
) -> Row {
    Row {
        op,
        price,
        source,
        records: None,
        example,
    }
}

const fn creates(
    op: &'static str,
    kind: &'static str,
    id: &'static str,
    source: &'static str,
    example: (&'static str, &'static str),
) -> Row {
    Row {
        op,
        price: RowPrice::Body,
        source,
        records: Some((kind, id)),
        example,
    }
}

/// Stripe v1 [ST-API]. Amounts are integers of the currency's smallest unit.
pub const STRIPE: &[Row] = &[
    creates("POST /v1/payment_intents", "payment_intent", "id", "https://docs.stripe.com/api/payment_intents/create", ("/v1/payment_intents", r#"{"amount":5000,"currency":"usd"}"#)),
    row("POST /v1/payment_intents/*", RowPrice::UnpricedIf(&["amount", "currency"], "an update that changes what a PaymentIntent takes is not counted at its creation"), "https://docs.stripe.com/api/payment_intents/update", ("/v1/payment_intents/pi_x", r#"{"amount":5000}"#)),
    row("POST /v1/payment_intents/*/confirm", RowPrice::Counted("payment_intent", 2), "https://docs.stripe.com/api/payment_intents/confirm", ("/v1/payment_intents/pi_x/confirm", r#"{"payment_method":"pm_card_visa"}"#)),
    row("POST /v1/payment_intents/*/capture", RowPrice::Counted("payment_intent", 2), "https://docs.stripe.com/api/payment_intents/capture", ("/v1/payment_intents/pi_x/capture", "{}")),
    row("POST /v1/payment_intents/*/increment_authorization", RowPrice::Unpriced("the new total is in `amount`, its currency is the PaymentIntent's, not in the request"), "https://docs.stripe.com/api/payment_intents/increment_authorization", ("/v1/payment_intents/pi_x/increment_authorization", r#"{"amount":9000}"#)),
    creates("POST /v1/charges", "charge", "id", "https://docs.stripe.com/api/charges/create", ("/v1/charges", r#"{"amount":5000,"currency":"usd","source":"tok_visa"}"#)),
    row("POST /v1/charges/*/capture", RowPrice::Counted("charge", 2), "https://docs.stripe.com/api/charges/capture", ("/v1/charges/ch_x/capture", "{}")),
    row("POST /v1/invoices/*/pay", RowPrice::Unpriced("an invoice's total is on the invoice, not in the request"), "https://docs.stripe.com/api/invoices/pay", ("/v1/invoices/in_x/pay", "{}")),
    row("POST /v1/invoices/*/finalize", RowPrice::Unpriced("a finalized invoice with auto_advance is collected; its total is not in the request"), "https://docs.stripe.com/api/invoices/finalize", ("/v1/invoices/in_x/finalize", "{}")),
    row("POST /v1/invoiceitems", RowPrice::Unpriced("an invoice item may be priced by a Price object and is collected with its invoice"), "https://docs.stripe.com/api/invoiceitems/create", ("/v1/invoiceitems", r#"{"customer":"cus_x","amount":5000,"currency":"usd"}"#)),
    row("POST /v1/invoiceitems/*", RowPrice::Unpriced("an invoice item update may change what its invoice collects"), "https://docs.stripe.com/api/invoiceitems/update", ("/v1/invoiceitems/ii_x", r#"{"amount":5000}"#)),
    row("POST /v1/subscriptions", RowPrice::Unpriced("a subscription charges by its prices, not by an amount in the request"), "https://docs.stripe.com/api/subscriptions/create", ("/v1/subscriptions", r#"{"customer":"cus_x","items":[{"price":"price_x"}]}"#)),
    row("POST /v1/subscriptions/*", RowPrice::Unpriced("a subscription update may change and prorate what it charges"), "https://docs.stripe.com/api/subscriptions/update", ("/v1/subscriptions/sub_x", r#"{"items":[{"price":"price_y"}]}"#)),
    row("POST /v1/subscription_items", RowPrice::Unpriced("a subscription item charges by its price"), "https://docs.stripe.com/api/subscription_items/create", ("/v1/subscription_items", r#"{"subscription":"sub_x","price":"price_x"}"#)),
    row("POST /v1/subscription_items/*", RowPrice::Unpriced("a subscription item update may change what it charges"), "https://docs.stripe.com/api/subscription_items/update", ("/v1/subscription_items/si_x", r#"{"quantity":9}"#)),
    row("POST /v1/checkout/sessions", RowPrice::Unpriced("a Checkout Session's line items are priced by Price objects"), "https://docs.stripe.com/api/checkout/sessions/create", ("/v1/checkout/sessions", r#"{"mode":"payment","line_items":[{"price":"price_x","quantity":1}]}"#)),
    row("POST /v1/payment_links", RowPrice::Unpriced("a payment link's line items are priced by Price objects, and it can be paid many times"), "https://docs.stripe.com/api/payment-link/create", ("/v1/payment_links", r#"{"line_items":[{"price":"price_x","quantity":1}]}"#)),
    row("POST /v1/quotes/*/accept", RowPrice::Unpriced("an accepted quote becomes an invoice or subscription for its total, not in the request"), "https://docs.stripe.com/api/quotes/accept", ("/v1/quotes/qt_x/accept", "{}")),
    row("POST /v1/payouts", RowPrice::Body, "https://docs.stripe.com/api/payouts/create", ("/v1/payouts", r#"{"amount":5000,"currency":"usd"}"#)),
    row("POST /v1/transfers", RowPrice::Body, "https://docs.stripe.com/api/transfers/create", ("/v1/transfers", r#"{"amount":5000,"currency":"usd","destination":"acct_x"}"#)),
    row("POST /v1/topups", RowPrice::Body, "https://docs.stripe.com/api/topups/create", ("/v1/topups", r#"{"amount":5000,"currency":"usd"}"#)),
    row("POST /v1/treasury/outbound_payments", RowPrice::Body, "https://docs.stripe.com/api/treasury/outbound_payments/create", ("/v1/treasury/outbound_payments", r#"{"amount":5000,"currency":"usd","financial_account":"fa_x"}"#)),
    row("POST /v1/treasury/outbound_transfers", RowPrice::Body, "https://docs.stripe.com/api/treasury/outbound_transfers/create", ("/v1/treasury/outbound_transfers", r#"{"amount":5000,"currency":"usd","financial_account":"fa_x"}"#)),
];

/// Alpaca Trading and Broker API [ALP]. Amounts are decimal strings of USD.
pub const ALPACA: &[Row] = &[
    row("POST /v2/orders", RowPrice::Body, "https://docs.alpaca.markets/reference/postorder", ("/v2/orders", r#"{"symbol":"AAPL","side":"buy","type":"limit","time_in_force":"day","qty":"1","limit_price":"50","client_order_id":"c1"}"#)),
    row("PATCH /v2/orders/*", RowPrice::Fields(&["{body.qty} * {body.limit_price}"], "usd", "major"), "https://docs.alpaca.markets/reference/patchorderbyorderid-1", ("/v2/orders/ord_x", r#"{"qty":"1","limit_price":"50","client_order_id":"c2"}"#)),
    row("DELETE /v2/positions", RowPrice::Unpriced("closing every position sells at the market: its proceeds and cost are not in the request"), "https://docs.alpaca.markets/reference/deleteallopenpositions-1", ("/v2/positions", "")),
    row("DELETE /v2/positions/*", RowPrice::Unpriced("closing a position sells at the market: its value is not in the request"), "https://docs.alpaca.markets/reference/deleteopenposition-1", ("/v2/positions/AAPL", "")),
    row("POST /v1/trading/accounts/*/orders", RowPrice::Body, "https://docs.alpaca.markets/reference/createorderforaccount-1", ("/v1/trading/accounts/acc_x/orders", r#"{"symbol":"AAPL","side":"buy","type":"limit","time_in_force":"day","notional":"50","client_order_id":"c3"}"#)),
    row("PATCH /v1/trading/accounts/*/orders/*", RowPrice::Fields(&["{body.qty} * {body.limit_price}"], "usd", "major"), "https://docs.alpaca.markets/reference/replaceorderforaccount-1", ("/v1/trading/accounts/acc_x/orders/ord_x", r#"{"qty":"1","limit_price":"50","client_order_id":"c4"}"#)),
    row("DELETE /v1/trading/accounts/*/positions", RowPrice::Unpriced("closing every position of an account sells at the market"), "https://docs.alpaca.markets/reference/closeallpositionsforaccount-1", ("/v1/trading/accounts/acc_x/positions", "")),
    row("DELETE /v1/trading/accounts/*/positions/*", RowPrice::Unpriced("closing a position sells at the market"), "https://docs.alpaca.markets/reference/closepositionforaccountbysymbol-1", ("/v1/trading/accounts/acc_x/positions/AAPL", "")),
    row("POST /v1/journals", RowPrice::Fields(&["{body.amount}"], "usd", "major"), "https://docs.alpaca.markets/reference/createjournal-1", ("/v1/journals", r#"{"from_account":"a","to_account":"b","entry_type":"JNLC","amount":"50"}"#)),
    row("POST /v1/journals/batch", RowPrice::Fields(&["{body.entries.*.amount}"], "usd", "major"), "https://docs.alpaca.markets/reference/createbatchjournal-1", ("/v1/journals/batch", r#"{"entry_type":"JNLC","from_account":"a","entries":[{"to_account":"b","amount":"30"},{"to_account":"c","amount":"20"}]}"#)),
    row("POST /v1/accounts/*/transfers", RowPrice::Fields(&["{body.amount}"], "usd", "major"), "https://docs.alpaca.markets/reference/createtransferforaccount-1", ("/v1/accounts/acc_x/transfers", r#"{"transfer_type":"ach","relationship_id":"r","amount":"50","direction":"OUTGOING"}"#)),
];

/// Square [SQ].
pub const SQUARE: &[Row] = &[
    creates(
        "POST /v2/payments",
        "payment",
        "payment.id",
        "https://developer.squareup.com/reference/square/payments-api/create-payment",
        (
            "/v2/payments",
            r#"{"idempotency_key":"sq1","source_id":"cnon:x","amount_money":{"amount":5000,"currency":"USD"},"autocomplete":false}"#,
        ),
    ),
    row(
        "PUT /v2/payments/*",
        RowPrice::UnpricedIf(
            &["payment.amount_money", "payment.tip_money"],
            "an update that changes what a payment takes is not counted at its creation",
        ),
        "https://developer.squareup.com/reference/square/payments-api/update-payment",
        (
            "/v2/payments/p_x",
            r#"{"idempotency_key":"sq2","payment":{"amount_money":{"amount":9000,"currency":"USD"}}}"#,
        ),
    ),
    row(
        "POST /v2/payments/*/complete",
        RowPrice::Counted("payment", 2),
        "https://developer.squareup.com/reference/square/payments-api/complete-payment",
        ("/v2/payments/p_x/complete", "{}"),
    ),
    row(
        "POST /v2/orders/*/pay",
        RowPrice::Unpriced("an order is paid by payments named by id, for the order's total"),
        "https://developer.squareup.com/reference/square/orders-api/pay-order",
        (
            "/v2/orders/o_x/pay",
            r#"{"idempotency_key":"sq3","payment_ids":["p_y"]}"#,
        ),
    ),
    row(
        "POST /v2/invoices/*/publish",
        RowPrice::Unpriced("a published invoice may charge a card on file for its total"),
        "https://developer.squareup.com/reference/square/invoices-api/publish-invoice",
        (
            "/v2/invoices/inv_x/publish",
            r#"{"idempotency_key":"sq4","version":1}"#,
        ),
    ),
];

/// Adyen Checkout and Transfers [ADY]. Amounts in the minor units Adyen lists.
pub const ADYEN: &[Row] = &[
    creates("POST /*/payments", "payment", "pspReference", "https://docs.adyen.com/api-explorer/Checkout/latest/post/payments", ("/v71/payments", r#"{"amount":{"value":5000,"currency":"USD"},"merchantAccount":"m","reference":"r1"}"#)),
    row("POST /*/payments/*/captures", RowPrice::Counted("payment", 2), "https://docs.adyen.com/api-explorer/Checkout/latest/post/payments/(paymentPspReference)/captures", ("/v71/payments/psp_x/captures", r#"{"amount":{"value":5000,"currency":"USD"},"merchantAccount":"m"}"#)),
    row("POST /*/payments/*/amountUpdates", RowPrice::Unpriced("the new amount of an authorisation, not counted at its creation"), "https://docs.adyen.com/api-explorer/Checkout/latest/post/payments/(paymentPspReference)/amountUpdates", ("/v71/payments/psp_x/amountUpdates", r#"{"amount":{"value":9000,"currency":"USD"},"merchantAccount":"m"}"#)),
    row("POST /*/transfers", RowPrice::Body, "https://docs.adyen.com/api-explorer/transfers/latest/post/transfers", ("/v4/transfers", r#"{"amount":{"value":5000,"currency":"USD"},"balanceAccountId":"b","category":"bank"}"#)),
];

/// PayPal REST [PP]. Amounts are decimal strings of the major unit.
pub const PAYPAL: &[Row] = &[
    creates(
        "POST /v2/checkout/orders",
        "order",
        "id",
        "https://developer.paypal.com/docs/api/orders/v2/#orders_create",
        (
            "/v2/checkout/orders",
            r#"{"intent":"CAPTURE","purchase_units":[{"amount":{"currency_code":"USD","value":"50.00"}}]}"#,
        ),
    ),
    row(
        "POST /v2/checkout/orders/*/capture",
        RowPrice::Counted("order", 3),
        "https://developer.paypal.com/docs/api/orders/v2/#orders_capture",
        ("/v2/checkout/orders/o_x/capture", "{}"),
    ),
    row(
        "POST /v2/checkout/orders/*/authorize",
        RowPrice::Counted("order", 3),
        "https://developer.paypal.com/docs/api/orders/v2/#orders_authorize",
        ("/v2/checkout/orders/o_x/authorize", "{}"),
    ),
    row(
        "POST /v2/payments/authorizations/*/capture",
        RowPrice::Unpriced(
            "an authorization's amount is the authorization's unless the request names one",
        ),
        "https://developer.paypal.com/docs/api/payments/v2/#authorizations_capture",
        ("/v2/payments/authorizations/a_x/capture", "{}"),
    ),
    row(
        "POST /v1/payments/payouts",
        RowPrice::Fields(
            &["{body.items.*.amount.value}"],
            "{body.items.*.amount.currency}",
            "major",
        ),
        "https://developer.paypal.com/docs/api/payments.payouts-batch/v1/#payouts_post",
        (
            "/v1/payments/payouts",
            r#"{"sender_batch_header":{"sender_batch_id":"b1"},"items":[{"amount":{"value":"30.00","currency":"USD"},"receiver":"a@example.test"},{"amount":{"value":"20.00","currency":"USD"},"receiver":"b@example.test"}]}"#,
        ),
    ),
];

/// Checkout.com [CKO]. Amounts in the minor unit.
pub const CHECKOUT: &[Row] = &[
    creates(
        "POST /payments",
        "payment",
        "id",
        "https://api-reference.checkout.com/#operation/requestAPaymentOrPayout",
        (
            "/payments",
            r#"{"amount":5000,"currency":"USD","source":{"type":"token","token":"tok_x"},"capture":false}"#,
        ),
    ),
    row(
        "POST /payments/*/captures",
        RowPrice::Counted("payment", 1),
        "https://api-reference.checkout.com/#operation/captureAPayment",
        ("/payments/pay_x/captures", r#"{"amount":5000}"#),
    ),
    row(
        "POST /payments/*/authorizations",
        RowPrice::Unpriced(
            "an incremental authorization's currency is the payment's, not in the request",
        ),
        "https://api-reference.checkout.com/#operation/incrementPaymentAuthorization",
        ("/payments/pay_x/authorizations", r#"{"amount":9000}"#),
    ),
];

/// Razorpay [RZP]. Amounts in the currency's subunit (paise).
pub const RAZORPAY: &[Row] = &[
    row(
        "POST /v1/payouts",
        RowPrice::Body,
        "https://razorpay.com/docs/api/x/payouts/create/bank-account/",
        (
            "/v1/payouts",
            r#"{"account_number":"1","fund_account_id":"fa_x","amount":5000,"currency":"INR","mode":"IMPS","purpose":"payout"}"#,
        ),
    ),
    row(
        "POST /v1/payments/*/capture",
        RowPrice::Body,
        "https://razorpay.com/docs/api/payments/capture/",
        (
            "/v1/payments/pay_x/capture",
            r#"{"amount":5000,"currency":"INR"}"#,
        ),
    ),
    row(
        "POST /v1/transfers",
        RowPrice::Body,
        "https://razorpay.com/docs/api/payments/route/create-transfers-link/",
        (
            "/v1/transfers",
            r#"{"account":"acc_x","amount":5000,"currency":"INR"}"#,
        ),
    ),
];

/// Stripe's zero- and three-decimal currencies where they differ from ISO 4217, and ISK,
/// which Stripe writes with two decimals [ST-CUR]: https://docs.stripe.com/currencies#zero-decimal
/// (ISO gives MGA two decimals; Stripe none.) Every other code counts as ISO 4217 says.
pub const STRIPE_EXPONENTS: &[(&str, u32)] = &[
    ("BIF", 0),
    ("CLP", 0),
    ("DJF", 0),
    ("GNF", 0),
    ("JPY", 0),
    ("KMF", 0),
    ("KRW", 0),
    ("MGA", 0),
    ("PYG", 0),
    ("RWF", 0),
    ("UGX", 0),
    ("VND", 0),
    ("VUV", 0),
    ("XAF", 0),
    ("XOF", 0),
    ("XPF", 0),
    ("BHD", 3),
    ("JOD", 3),
    ("KWD", 3),
    ("OMR", 3),
    ("TND", 3),
    ("ISK", 2),
];

/// Adyen's minor units where they differ from ISO 4217 [ADY-AMOUNT]:
/// https://docs.adyen.com/development-resources/currency-codes ("differs from standard").
pub const ADYEN_EXPONENTS: &[(&str, u32)] = &[("CLP", 2), ("CVE", 0), ("IDR", 0), ("ISK", 2)];
