//! Built-in provider profiles: how each provider tells accounts apart, what its signing
//! changes on every attempt, where it takes an idempotency key and what keys it accepts,
//! whether it deduplicates on them, and which of its answers are final. A route's own fields
//! override every part of a profile. `docs/providers.md` lists the sources behind each entry;
//! the short tags in the comments below refer to it.

pub mod catalogue;

use std::time::Duration;

use http::HeaderName;

use crate::config::LookupConfig;
use crate::idempotency::policy::{BodyRule, Condition, RuleOutcome, StatusSet, Test};
use crate::identity::account::AccountPart;
use crate::identity::key_limits::{default_limits, KeyLimits, VISIBLE_ASCII};
use crate::identity::provider_key::KeyField;
use crate::identity::Signing;
use crate::identity::{KeySource, MissingKey};
use crate::request::path::PathRules;
use crate::request::template::Template;

/// Everything a profile sets, resolved.
#[derive(Debug, Clone)]
pub struct Profile {
    pub name: &'static str,
    /// The provider deduplicates requests carrying the same key, so an uncertain outcome
    /// may be retried with the same key.
    pub honours_key: bool,
    /// Where the provider takes its key; `None`: it takes none.
    pub key_field: Option<KeyField>,
    pub limits: KeyLimits,
    /// Statuses kept as the receipt; `None`: the proxy's default.
    pub commit_statuses: Option<&'static [&'static str]>,
    /// Statuses that leave the outcome UNKNOWN without provider keys; `None`: the default.
    pub unknown_statuses: Option<&'static [u16]>,
    pub rules: Vec<BodyRule>,
    /// Hold UNKNOWN outcomes until an operator resolves them (`hold = "forever"`).
    pub hold_forever: bool,
    pub account: Vec<AccountPart>,
    pub volatile: &'static [&'static str],
    pub signing: Signing,
    /// Where a route without a template takes the operation's identity from.
    pub key_source: Option<KeySource>,
    /// What a request without a key gets on a route that does not say (`missing_key`).
    pub missing_key: Option<MissingKey>,
    pub retention: Option<Duration>,
    pub dedup_window: Option<Duration>,
    /// How to ask the provider whether a held operation happened.
    pub lookup: Option<LookupConfig>,
    /// What its money-moving requests cost, for `[routes.spend]`.
    pub spend: Option<SpendDefaults>,
    /// How its own errors look: refusals the proxy makes on its behalf (caps, approvals)
    /// take this shape, so its SDKs raise a meaningful error.
    pub errors: ErrorShape,
    /// Other hosts of the provider that perform side effects outside the API the route
    /// protects (SMTP relays, an MCP server, upload or regional hosts; `*` stands for one
    /// label): CONNECT to them is refused unless a route of their own covers them.
    pub side_doors: &'static [SideDoor],
    /// What its paths may hold beyond the proxy's grammar (`request::path`).
    pub path: PathRules,
}

/// A profile's defaults for `[routes.spend]`: which requests cost money and where the amount
/// is (every one from the provider's API reference; tags as below).
#[derive(Debug, Clone, Copy)]
pub struct SpendDefaults {
    /// The requests that move or change money, each with how it is priced and its source.
    pub rows: &'static [catalogue::Row],
    /// Of those, the ones whose requests without a key may derive an identity from the whole
    /// request (charges); the others (money out, orders) are refused without one.
    pub derive_without_key: &'static [&'static str],
    pub amount: &'static [&'static str],
    pub currency: &'static str,
    pub unit: &'static str,
    /// Currencies whose minor unit the provider counts otherwise than ISO 4217.
    pub exponents: &'static [(&'static str, u32)],
}

/// The error body a provider's SDKs parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `application/problem+json` (no provider, or one without a documented error body).
    Problem,
    /// `{"error": {"type", "code", "message"}}` [SD]
    Stripe,
    /// `{"errors": [{"category", "code", "detail"}]}` [SQ]
    Square,
    /// `{"status", "errorCode", "message", "errorType"}` [ADY]
    Adyen,
    /// `{"name", "message", "debug_id"}` [PP]
    PayPal,
    /// `{"code", "message"}` [ALP]
    Alpaca,
    /// A JSON-RPC error response (routes with `protocol = "mcp"`): MCP clients raise it as the
    /// call's error.
    JsonRpc,
}

/// A rule as written in a profile: statuses, `(field, test)` conditions, outcome, note.
struct RuleSpec {
    statuses: Option<&'static [&'static str]>,
    all: &'static [(&'static str, TestSpec)],
    outcome: RuleOutcome,
    note: &'static str,
}

#[derive(Clone, Copy)]
enum TestSpec {
    Equals(&'static [&'static str]),
    NotEquals(&'static [&'static str]),
    Prefix(&'static [&'static str]),
}

#[derive(Clone, Copy)]
enum Part {
    Headers(&'static [&'static str]),
    SigV4,
    BearerSubject,
    PathAfter(&'static str),
    /// One secret key as `Bearer KEY` or Basic `KEY:`.
    BearerOrBasicUser,
    /// `(header, body field)` pairs carrying one credential either way.
    HeaderOrBody(&'static [(&'static str, &'static str)]),
}

struct Spec {
    name: &'static str,
    honours_key: bool,
    header: Option<&'static str>,
    body_field: Option<&'static str>,
    min_len: usize,
    max_len: usize,
    charset: &'static str,
    commit_statuses: Option<&'static [&'static str]>,
    unknown_statuses: Option<&'static [u16]>,
    rules: &'static [RuleSpec],
    hold_forever: bool,
    account: &'static [Part],
    volatile: &'static [&'static str],
    signing: Signing,
    key_source: Option<KeySource>,
    missing_key: Option<MissingKey>,
    retention: Option<Duration>,
    dedup_window: Option<Duration>,
    /// `(request, found statuses, not found statuses, field a found answer carries)`.
    lookup: Option<(&'static str, &'static str, &'static str, &'static str)>,
    spend: Option<SpendDefaults>,
    errors: ErrorShape,
    side_doors: &'static [SideDoor],
    path: PathRules,
}

/// A host of a provider where requests take effect past the route that protects its API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideDoor {
    /// The host; `*` stands for exactly one label.
    pub host: &'static str,
    /// What it is, in the refusal's words: "the SMTP relay", "the MCP server"…
    pub what: &'static str,
}

const fn smtp(host: &'static str) -> SideDoor {
    SideDoor {
        host,
        what: "SMTP relay",
    }
}

const fn door(host: &'static str, what: &'static str) -> SideDoor {
    SideDoor { host, what }
}

const DAY: Duration = Duration::from_secs(24 * 3600);
/// Money and trading: a failed agent run is often re-triggered the next day, so receipts are
/// kept a week (docs/operations.md gives the disk this costs).
const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

const HEADER: Spec = Spec {
    name: "",
    honours_key: true,
    header: Some("Idempotency-Key"),
    body_field: None,
    min_len: 1,
    max_len: 255,
    charset: VISIBLE_ASCII,
    commit_statuses: None,
    unknown_statuses: None,
    rules: &[],
    hold_forever: false,
    account: &[Part::Headers(&["authorization"])],
    volatile: &[],
    signing: Signing::None,
    key_source: None,
    missing_key: None,
    retention: Some(WEEK),
    dedup_window: None,
    lookup: None,
    spend: None,
    errors: ErrorShape::Problem,
    side_doors: &[],
    path: PathRules {
        encoded_slash: false,
    },
};

/// How long an email or message sent without a key counts as sent, so an agent's re-run of
/// the tool is the same send: an hour covers a retried run; the same text to the same
/// recipient sent on purpose twice within it goes out once (docs/providers.md).
const MESSAGE_WINDOW: Duration = Duration::from_secs(3600);

/// No provider-side deduplication: the proxy's claim is the only protection, and ambiguous
/// outcomes (timeouts, 500/502/504) are held as UNKNOWN. Email and SMS APIs: their SDKs send
/// no key, so a request without one is identified by its whole content within an hour
/// rather than forwarded unprotected.
const NO_KEY: Spec = Spec {
    honours_key: false,
    header: None,
    retention: None,
    missing_key: Some(MissingKey::Derive),
    dedup_window: Some(MESSAGE_WINDOW),
    ..HEADER
};

/// An exchange: it signs the body, so the proxy never changes it and cannot pass a key of its
/// own down; its client order id is unique only among open orders, so it is not trusted to
/// deduplicate, and an ambiguous outcome is held until someone looks the order up.
const EXCHANGE: Spec = Spec {
    honours_key: false,
    header: None,
    signing: Signing::Body,
    hold_forever: true,
    ..HEADER
};

const SPECS: &[Spec] = &[
    // Stripe v1: `Idempotency-Key` ≤ 255, kept ≥ 24 h, replays even 500s [SD]. Account: the
    // secret key and the connected account it acts for (`Stripe-Account`, `Stripe-Context`)
    // [ST-CONNECT]; the key goes as `Bearer sk_…` (the SDKs) or as Basic with the key as user
    // and no password (`curl -u sk_…:`, as the API reference writes it) [ST-AUTH]: one account. The official SDKs mint a random key per call [SP], so a route without a
    // template keys on the whole request for 24 h (the time Stripe keeps keys): an agent's
    // re-run is one charge; two deliberate identical charges in a day need a field that
    // differs (metadata) or `key_source = "client"`.
    Spec {
        name: "stripe",
        // Same key, other parameters (or endpoint): Stripe's `idempotency_error` [SD]. The
        // operation under that key exists; this answer is not its response.
        rules: &[RuleSpec {
            statuses: Some(&["400"]),
            all: &[("error.type", TestSpec::Equals(&["idempotency_error"]))],
            outcome: RuleOutcome::Duplicate,
            note: "Stripe already has a request under the key passed down, with other parameters. Look it up in the Dashboard's request log by Idempotency-Key {key}",
        }],
        account: &[
            Part::BearerOrBasicUser,
            Part::Headers(&["stripe-account", "stripe-context"]),
        ],
        key_source: Some(KeySource::Request),
        dedup_window: Some(DAY),
        // Amounts are integers of the smallest currency unit, in Stripe's own list of
        // zero- and three-decimal currencies [ST-AMOUNT]. A PaymentIntent counts when it is
        // created; confirming or capturing one the proxy counted costs nothing more.
        spend: Some(SpendDefaults {
            rows: catalogue::STRIPE,
            derive_without_key: &["POST /v1/payment_intents", "POST /v1/charges"],
            amount: &["{body.amount}"],
            currency: "{body.currency}",
            unit: "minor",
            exponents: catalogue::STRIPE_EXPONENTS,
        }),
        errors: ErrorShape::Stripe,
        // Hosts its SDKs and agent toolkit reach besides api.stripe.com [ST-HOSTS]: the remote
        // MCP server (the agent toolkit's tools run there), file uploads, OAuth for connected
        // accounts, and the meter event stream (usage that is billed).
        side_doors: &[
            door("mcp.stripe.com", "MCP server"),
            door("files.stripe.com", "upload API"),
            door("connect.stripe.com", "Connect OAuth API"),
            door("meter-events.stripe.com", "meter events API"),
        ],
        ..HEADER
    },
    // Adyen: `Idempotency-Key` ≤ 64, kept ≥ 31 days [ADY]; API key in `X-API-Key`.
    Spec {
        name: "adyen",
        max_len: 64,
        account: &[Part::Headers(&["x-api-key", "authorization"])],
        // `/vNN/payments`, `amount.value` in minor units [ADY-AMOUNT].
        spend: Some(SpendDefaults {
            rows: catalogue::ADYEN,
            derive_without_key: &["POST /*/payments"],
            amount: &["{body.amount.value}"],
            currency: "{body.amount.currency}",
            unit: "minor",
            exponents: catalogue::ADYEN_EXPONENTS,
        }),
        errors: ErrorShape::Adyen,
        ..HEADER
    },
    // PayPal REST: `PayPal-Request-Id` [PP]. Access tokens are refreshed: a route whose
    // tools refresh them between attempts sets `account` (docs/security.md).
    Spec {
        name: "paypal",
        header: Some("PayPal-Request-Id"),
        account: &[Part::Headers(&["authorization", "paypal-auth-assertion"])],
        // An order's purchase units each carry `amount.value`, a decimal string [PP-ORDER]:
        // all of them count, and all must be in one currency.
        spend: Some(SpendDefaults {
            rows: catalogue::PAYPAL,
            derive_without_key: &["POST /v2/checkout/orders"],
            amount: &["{body.purchase_units.*.amount.value}"],
            currency: "{body.purchase_units.*.amount.currency_code}",
            unit: "major",
            exponents: &[],
        }),
        errors: ErrorShape::PayPal,
        ..HEADER
    },
    // Checkout.com: `Cko-Idempotency-Key`; only 2xx are stored, 4xx/5xx are re-attempted
    // [CKO], so only 2xx become receipts here too.
    Spec {
        name: "checkout",
        header: Some("Cko-Idempotency-Key"),
        commit_statuses: Some(&["2xx"]),
        // `amount` in the minor unit [CKO-PAY].
        spend: Some(SpendDefaults {
            rows: catalogue::CHECKOUT,
            derive_without_key: &["POST /payments"],
            amount: &["{body.amount}"],
            currency: "{body.currency}",
            unit: "minor",
            exponents: &[],
        }),
        ..HEADER
    },
    // GoCardless: `Idempotency-Key`; a reused key answers 409 `idempotent_creation_conflict`
    // [GC], which is never committed: it passes through and the claim is released.
    Spec {
        name: "gocardless",
        ..HEADER
    },
    // Resend: `Idempotency-Key` ≤ 256, kept 24 h [RS]. SMTP relay: smtp.resend.com [RS-SMTP].
    // Its SDKs send a key only when the tool passes one [RS-PY]: without one, the whole
    // request is the email for 24 h, the derived key passed down (Resend keeps it as long).
    Spec {
        name: "resend",
        max_len: 256,
        retention: None,
        missing_key: Some(MissingKey::Derive),
        dedup_window: Some(DAY),
        side_doors: &[smtp("smtp.resend.com")],
        ..HEADER
    },
    // Razorpay X payouts: `X-Payout-Idempotency`, 4–36 of `[A-Za-z0-9 _-]` [RZP].
    Spec {
        name: "razorpay",
        header: Some("X-Payout-Idempotency"),
        min_len: 4,
        max_len: 36,
        charset: "A-Za-z0-9 _-",
        // `amount` in paise [RZP].
        spend: Some(SpendDefaults {
            rows: catalogue::RAZORPAY,
            derive_without_key: &[],
            amount: &["{body.amount}"],
            currency: "{body.currency}",
            unit: "minor",
            exponents: &[],
        }),
        ..HEADER
    },
    // Square: body `idempotency_key`, 1–45 on CreatePayment, the tightest endpoint [SQ].
    Spec {
        name: "square",
        header: None,
        body_field: Some("idempotency_key"),
        max_len: 45,
        // `amount_money` {amount in the smallest denomination, currency} [SQ-MONEY].
        spend: Some(SpendDefaults {
            rows: catalogue::SQUARE,
            derive_without_key: &["POST /v2/payments"],
            amount: &["{body.amount_money.amount}"],
            currency: "{body.amount_money.currency}",
            unit: "minor",
            exponents: &[],
        }),
        errors: ErrorShape::Square,
        ..HEADER
    },
    // Plaid: body `idempotency_key` ≤ 50 [PL]. Account: `client_id` and `secret`, in headers
    // or the body [PL-SDK]; both leave the fingerprint (a credential; header or body alike).
    Spec {
        name: "plaid",
        header: None,
        body_field: Some("idempotency_key"),
        max_len: 50,
        account: &[Part::HeaderOrBody(&[
            ("plaid-client-id", "client_id"),
            ("plaid-secret", "secret"),
        ])],
        volatile: &["client_id", "secret"],
        ..HEADER
    },
    // Alpaca: body `client_order_id` ≤ 128 [ALP]. A duplicate is rejected with 422
    // `{"code":40010001}` [ALP422] rather than replayed, and uniqueness is reported only
    // among active orders, so Alpaca is not trusted to deduplicate: ambiguous outcomes are
    // held until someone looks the order up. Account: the key id and secret headers (or
    // OAuth/Basic `Authorization`), and the account in Broker API paths [ALP-AUTH].
    Spec {
        name: "alpaca",
        honours_key: false,
        header: None,
        body_field: Some("client_order_id"),
        max_len: 128,
        rules: &[RuleSpec {
            statuses: Some(&["422"]),
            all: &[("code", TestSpec::Equals(&["40010001"]))],
            outcome: RuleOutcome::Duplicate,
            note: "Alpaca already has an order with this client_order_id (code 40010001). Look it up with GET /v2/orders:by_client_order_id?client_order_id={key}",
        }],
        // Orders by client order id: 200 with the order, 404 `{"code":40410000}` [ALP-PY].
        lookup: Some((
            "GET /v2/orders:by_client_order_id?client_order_id={key}",
            "200",
            "404",
            "id",
        )),
        hold_forever: true,
        account: &[
            Part::Headers(&["apca-api-key-id", "apca-api-secret-key", "authorization"]),
            Part::PathAfter("accounts"),
        ],
        // An order's cost: `notional` (dollars), else quantity × limit price, decimal
        // strings [ALP]. A market order by quantity has no price to count: refused on a
        // capped route.
        spend: Some(SpendDefaults {
            rows: catalogue::ALPACA,
            derive_without_key: &[],
            amount: &["{body.notional}", "{body.qty} * {body.limit_price}"],
            currency: "usd",
            unit: "major",
            exponents: &[],
        }),
        errors: ErrorShape::Alpaca,
        // Its other trading hosts [ALP-HOSTS]: live and paper trading (a route protects one;
        // the other takes orders too) and the Broker API. Market data changes nothing and is
        // not listed.
        side_doors: &[
            door("api.alpaca.markets", "live trading API"),
            door("paper-api.alpaca.markets", "paper trading API"),
            door("broker-api.alpaca.markets", "Broker API"),
            door("broker-api.sandbox.alpaca.markets", "Broker API sandbox"),
        ],
        // Crypto positions are named by their pair: `DELETE /v2/positions/BTC%2FUSD` when a
        // client encodes the symbol's slash (alpaca-py sends `BTC/USD` as two segments, which
        // Alpaca answers 404; `BTCUSD` works) [ALP-CRYPTO]. Rules match both readings.
        path: PathRules {
            encoded_slash: true,
        },
        ..HEADER
    },
    // Binance spot: `X-MBX-APIKEY`; HMAC over query + body with `timestamp`, `recvWindow`,
    // `signature` new on every attempt; parameters in any order, query or form body
    // [BN-REST]. `newClientOrderId` is unique among open orders only. Duplicate: -2010
    // "Duplicate order sent." [BN-ERR]. Any 5xx, -1006 and -1007: "execution status UNKNOWN".
    Spec {
        name: "binance",
        body_field: Some("newClientOrderId"),
        max_len: 36,
        charset: "A-Za-z0-9_-",
        unknown_statuses: Some(&[500, 502, 503, 504]),
        rules: &[
            RuleSpec {
                statuses: None,
                all: &[
                    ("code", TestSpec::Equals(&["-2010"])),
                    ("msg", TestSpec::Prefix(&["Duplicate order"])),
                ],
                outcome: RuleOutcome::Duplicate,
                note: "Duplicate order sent (-2010): the order exists. Look it up with GET /api/v3/order?symbol=…&origClientOrderId={key}",
            },
            RuleSpec {
                statuses: None,
                all: &[(
                    "code",
                    TestSpec::Equals(&["-1000", "-1001", "-1006", "-1007", "-1008"]),
                )],
                outcome: RuleOutcome::Unknown,
                note: "Binance says the execution status is unknown (-1006/-1007, or an internal error)",
            },
        ],
        account: &[Part::Headers(&["x-mbx-apikey"])],
        volatile: &["timestamp", "signature", "recvWindow"],
        ..EXCHANGE
    },
    // Coinbase Advanced Trade: CDP keys send a new JWT per request (`sub` = key name),
    // legacy keys `CB-ACCESS-KEY` + a signature over timestamp, method, path and body
    // [CB-PY][CB-LEGACY]. `client_order_id` is required; a repeated one returns the original
    // order [CB-CREATE], so the client's own id is honoured. Rejections come as
    // `{"success":false,"error_response":…}`.
    Spec {
        name: "coinbase",
        honours_key: true,
        body_field: Some("client_order_id"),
        rules: &[RuleSpec {
            statuses: Some(&["2xx"]),
            all: &[("success", TestSpec::Equals(&["false"]))],
            outcome: RuleOutcome::Decline,
            note: "the order was not created (success: false)",
        }],
        hold_forever: false,
        account: &[Part::BearerSubject, Part::Headers(&["cb-access-key"])],
        ..EXCHANGE
    },
    // Kraken spot: `API-Key`; `API-Sign` over path + SHA-256(nonce + body); body `nonce` and
    // `otp` new on every attempt [KR-AUTH]. Errors come inside HTTP 200 as `error: [...]`
    // ("E…" errors, "W…" warnings) [KR-INTRO]; `cl_ord_id` is unique among open orders [KR-CLID].
    Spec {
        name: "kraken",
        body_field: Some("cl_ord_id"),
        max_len: 36,
        rules: &[
            RuleSpec {
                statuses: None,
                all: &[(
                    "error",
                    TestSpec::Prefix(&[
                        "EService:Unavailable",
                        "EService:Busy",
                        "EService:Deadline elapsed",
                        "EGeneral:Internal error",
                    ]),
                )],
                outcome: RuleOutcome::Unknown,
                note: "Kraken's service was unavailable or busy while the order may have reached the matching engine",
            },
            RuleSpec {
                statuses: None,
                all: &[(
                    "error",
                    TestSpec::Prefix(&[
                        "EAPI:Invalid nonce",
                        "EAPI:Rate limit exceeded",
                        "EOrder:Rate limit exceeded",
                        "EOrder:Domain rate limit exceeded",
                        "EGeneral:Temporary lockout",
                    ]),
                )],
                outcome: RuleOutcome::Release,
                note: "refused before execution (nonce or rate limit): the retry executes",
            },
            RuleSpec {
                statuses: None,
                all: &[("error", TestSpec::Prefix(&["E"]))],
                outcome: RuleOutcome::Decline,
                note: "Kraken refused the order",
            },
        ],
        account: &[Part::Headers(&["api-key"])],
        volatile: &["nonce", "otp"],
        ..EXCHANGE
    },
    // OKX v5: `OK-ACCESS-KEY` (+ passphrase), signature over timestamp, method, path, body
    // [OKX-AUTH]. `clOrdId` unique among pending orders; 51016 = duplicate; 50004 "does not
    // mean that the request was successful or failed" (HTTP 400!) [OKX-ERR]; a rejected order
    // is `code` "1" with `data[0].sCode` ≠ "0" inside HTTP 200 [OKX-PLACE].
    Spec {
        name: "okx",
        body_field: Some("clOrdId"),
        max_len: 32,
        charset: "A-Za-z0-9",
        rules: &[
            RuleSpec {
                statuses: None,
                all: &[("code", TestSpec::Equals(&["50004", "50001", "50013", "50026"]))],
                outcome: RuleOutcome::Unknown,
                note: "OKX timed out or was unavailable; the order may exist",
            },
            RuleSpec {
                statuses: None,
                all: &[("data.0.sCode", TestSpec::Equals(&["51016"]))],
                outcome: RuleOutcome::Duplicate,
                note: "clOrdId already exists (51016): the order exists. Look it up with GET /api/v5/trade/order?instId=…&clOrdId={key}",
            },
            RuleSpec {
                statuses: None,
                all: &[("code", TestSpec::Equals(&["50011", "50061"]))],
                outcome: RuleOutcome::Release,
                note: "rate limited before execution: the retry executes",
            },
            RuleSpec {
                statuses: None,
                all: &[("code", TestSpec::NotEquals(&["0"]))],
                outcome: RuleOutcome::Decline,
                note: "OKX rejected the order",
            },
        ],
        account: &[Part::Headers(&[
            "ok-access-key",
            "ok-access-passphrase",
            "x-simulated-trading",
        ])],
        ..EXCHANGE
    },
    // Bybit v5: `X-BAPI-API-KEY`; signature over timestamp, key, recv window and the query
    // or raw JSON body [BB-GUIDE]. Every answer is `{"retCode": …}` inside HTTP 200; 10000,
    // 10016, 170001, 170007, 170146 are timeouts and internal errors; 110072, 170141 are a
    // duplicate `orderLinkId` [BB-ERR].
    Spec {
        name: "bybit",
        body_field: Some("orderLinkId"),
        max_len: 36,
        charset: "A-Za-z0-9_-",
        rules: &[
            RuleSpec {
                statuses: None,
                all: &[(
                    "retCode",
                    TestSpec::Equals(&["10000", "10016", "170001", "170007", "170146"]),
                )],
                outcome: RuleOutcome::Unknown,
                note: "Bybit timed out or failed internally; the order may exist",
            },
            RuleSpec {
                statuses: None,
                all: &[("retCode", TestSpec::Equals(&["110072", "170141", "10014"]))],
                outcome: RuleOutcome::Duplicate,
                note: "orderLinkId is a duplicate: the order exists. Look it up with GET /v5/order/realtime?category=…&orderLinkId={key}",
            },
            RuleSpec {
                statuses: None,
                all: &[("retCode", TestSpec::Equals(&["10006", "10002"]))],
                outcome: RuleOutcome::Release,
                note: "rate limited or outside the time window: the retry executes",
            },
            RuleSpec {
                statuses: None,
                all: &[("retCode", TestSpec::NotEquals(&["0"]))],
                outcome: RuleOutcome::Decline,
                note: "Bybit rejected the order",
            },
        ],
        account: &[Part::Headers(&["x-bapi-api-key"])],
        ..EXCHANGE
    },
    // KuCoin spot: `KC-API-KEY` (+ derived passphrase), signature over timestamp, method,
    // path, query and body [KC-DOC]; success is `code` "200000", failures may come in HTTP
    // 200 [KC-DOC]; 500000 is an internal error. `clientOid` ≤ 40 of `[A-Za-z0-9_-]` [KC-SPEC].
    Spec {
        name: "kucoin",
        body_field: Some("clientOid"),
        max_len: 40,
        charset: "A-Za-z0-9_-",
        rules: &[
            RuleSpec {
                statuses: None,
                all: &[("code", TestSpec::Equals(&["500000"]))],
                outcome: RuleOutcome::Unknown,
                note: "KuCoin failed internally; the order may exist",
            },
            RuleSpec {
                statuses: None,
                all: &[("msg", TestSpec::Prefix(&["validation.createOrder.clientOidDuplicated"]))],
                outcome: RuleOutcome::Duplicate,
                note: "clientOid is a duplicate: the order exists. Look it up with GET /api/v1/hf/orders/client-order/{key}?symbol=…",
            },
            RuleSpec {
                statuses: Some(&["2xx"]),
                all: &[("code", TestSpec::NotEquals(&["200000"]))],
                outcome: RuleOutcome::Decline,
                note: "KuCoin rejected the order",
            },
        ],
        account: &[Part::Headers(&["kc-api-key", "kc-api-passphrase", "kc-api-key-version"])],
        volatile: &["clientTimestamp"],
        ..EXCHANGE
    },
    // No request idempotency documented [SG][MG][PM][SES][TW].
    Spec {
        name: "sendgrid",
        account: &[Part::Headers(&["authorization", "on-behalf-of"])],
        // SMTP relay [SG-SMTP]; the EU data-residency API, which sends mail as the global one
        // does [SG-EU].
        side_doors: &[
            smtp("smtp.sendgrid.net"),
            door("api.eu.sendgrid.com", "EU-region API"),
        ],
        ..NO_KEY
    },
    Spec {
        name: "postmark",
        account: &[Part::Headers(&[
            "x-postmark-server-token",
            "x-postmark-account-token",
        ])],
        // SMTP servers, transactional and broadcast streams [PM-SMTP].
        side_doors: &[
            smtp("smtp.postmarkapp.com"),
            smtp("smtp-broadcasts.postmarkapp.com"),
        ],
        ..NO_KEY
    },
    Spec {
        name: "mailgun",
        account: &[Part::Headers(&["authorization", "x-mailgun-on-behalf-of"])],
        // SMTP in the US and EU regions [MG-SMTP]; the EU region's API [MG-EU].
        side_doors: &[
            smtp("smtp.mailgun.org"),
            smtp("smtp.eu.mailgun.org"),
            door("api.eu.mailgun.net", "EU-region API"),
        ],
        ..NO_KEY
    },
    // AWS SES v2: SigV4; the account is the access key id, region and service of the
    // `Credential` scope; the signature, `X-Amz-Date` and the session token change on every
    // signing [SIGV4]. SendEmail has no client token [SES].
    Spec {
        name: "ses",
        account: &[Part::SigV4],
        signing: Signing::SigV4,
        // The SMTP interface of every region [SES-SMTP], and the API of every other region
        // than the route's (boto3 picks one from the environment) [SES-REGION].
        side_doors: &[
            smtp("email-smtp.*.amazonaws.com"),
            door("email.*.amazonaws.com", "API in another region"),
        ],
        ..NO_KEY
    },
    // Twilio: Basic auth; the account is in the path (`Accounts/{AccountSid}`) [TW].
    Spec {
        name: "twilio",
        account: &[Part::Headers(&["authorization"]), Part::PathAfter("Accounts")],
        // Products of their own host that send messages (Verify, Messaging services,
        // Conversations…), and regional or edge hosts of every product [TW-HOSTS].
        side_doors: &[
            door("*.twilio.com", "product API"),
            door("*.*.twilio.com", "regional API"),
            door("*.*.*.twilio.com", "edge API"),
        ],
        ..NO_KEY
    },
];

fn build(spec: &Spec) -> Profile {
    let key_field = match (spec.header, spec.body_field) {
        (Some(h), _) => HeaderName::from_bytes(h.as_bytes())
            .ok()
            .map(KeyField::Header),
        (None, Some(f)) => Some(KeyField::Body(f.to_string())),
        (None, None) => None,
    };
    Profile {
        name: spec.name,
        honours_key: spec.honours_key,
        key_field,
        // The table is constant and covered by a test; fall back to the proxy's own limits
        // rather than panic if an entry were ever wrong.
        limits: KeyLimits::new(spec.min_len, spec.max_len, spec.charset)
            .unwrap_or_else(|_| default_limits()),
        commit_statuses: spec.commit_statuses,
        unknown_statuses: spec.unknown_statuses,
        rules: spec.rules.iter().filter_map(rule).collect(),
        hold_forever: spec.hold_forever,
        account: spec.account.iter().map(|p| part(*p)).collect(),
        volatile: spec.volatile,
        signing: spec.signing,
        key_source: spec.key_source,
        missing_key: spec.missing_key,
        retention: spec.retention,
        dedup_window: spec.dedup_window,
        lookup: spec
            .lookup
            .map(|(request, found, not_found, field)| LookupConfig {
                request: request.into(),
                found: vec![found.into()],
                not_found: vec![not_found.into()],
                found_field: Some(field.into()),
                after: crate::config::default_lookup_after(),
            }),
        spend: spec.spend,
        errors: spec.errors,
        side_doors: spec.side_doors,
        path: spec.path,
    }
}

fn rule(r: &RuleSpec) -> Option<BodyRule> {
    let statuses = match r.statuses {
        Some(s) => {
            Some(StatusSet::parse(&s.iter().map(|s| s.to_string()).collect::<Vec<_>>()).ok()?)
        }
        None => None,
    };
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    Some(BodyRule {
        statuses,
        conditions: r
            .all
            .iter()
            .map(|(field, test)| {
                Condition::new(
                    field,
                    match test {
                        TestSpec::Equals(v) => Test::Equals(strings(v)),
                        TestSpec::NotEquals(v) => Test::NotEquals(strings(v)),
                        TestSpec::Prefix(v) => Test::Prefix(strings(v)),
                    },
                )
            })
            .collect(),
        outcome: r.outcome,
        note: r.note.to_string(),
    })
}

fn part(p: Part) -> AccountPart {
    match p {
        Part::Headers(names) => AccountPart::Headers(
            names
                .iter()
                .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
                .collect(),
        ),
        Part::SigV4 => AccountPart::SigV4,
        Part::BearerSubject => AccountPart::BearerSubject,
        Part::PathAfter(segment) => AccountPart::PathAfter(segment.to_string()),
        Part::BearerOrBasicUser => AccountPart::BearerOrBasicUser,
        Part::HeaderOrBody(pairs) => AccountPart::HeaderOrBody(
            pairs
                .iter()
                .filter_map(|(h, f)| {
                    Some((HeaderName::from_bytes(h.as_bytes()).ok()?, body_field(f)?))
                })
                .collect(),
        ),
    }
}

/// A template reading one body field (`f:{body.client_id}`).
fn body_field(field: &str) -> Option<Template> {
    Template::parse(&format!("f:{{body.{field}}}")).ok()
}

pub fn lookup(name: &str) -> Option<Profile> {
    SPECS
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(name))
        .map(build)
}

pub fn names() -> Vec<&'static str> {
    SPECS.iter().map(|p| p.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn every_profile_table_entry_is_valid() {
        for spec in SPECS {
            KeyLimits::new(spec.min_len, spec.max_len, spec.charset)
                .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            let p = lookup(spec.name).expect("listed");
            assert_eq!(
                p.rules.len(),
                spec.rules.len(),
                "{}: every rule parses",
                spec.name
            );
            assert!(!p.account.is_empty(), "{}: names its account", spec.name);
            if p.signing.body_signed() {
                assert!(!p.honours_key || p.key_field.is_some(), "{}", spec.name);
            }
        }
        assert_eq!(names().len(), 21);
    }

    #[test]
    fn keys_that_fit_pass_unchanged_others_get_a_stable_hex_form() {
        let rzp = lookup("razorpay").expect("profile").limits;
        assert_eq!(rzp.fit("order 42_a-b"), "order 42_a-b");
        // Too short, too long, and a character outside the set.
        for bad in ["abc", &"x".repeat(37), "pay:inv-1"] {
            let fitted = rzp.fit(bad);
            assert_eq!(fitted.len(), 36, "{bad}");
            assert!(rzp.fits(&fitted), "{fitted}");
            assert_eq!(fitted, rzp.fit(bad), "deterministic");
            assert_eq!(
                fitted,
                hex::encode(Sha256::digest(bad.as_bytes()))[..36],
                "documented transform"
            );
        }
        assert_ne!(rzp.fit("abc"), rzp.fit("abd"));
        let adyen = lookup("adyen").expect("profile").limits;
        assert_eq!(adyen.fit(&"k".repeat(65)).len(), 64);
        assert_eq!(adyen.fit(&"k".repeat(64)), "k".repeat(64));
    }

    #[test]
    fn alpaca_duplicate_rejection_is_a_duplicate_rule() {
        let alpaca = lookup("alpaca").expect("profile");
        assert!(!alpaca.honours_key);
        assert_eq!(
            alpaca.key_field,
            Some(KeyField::Body("client_order_id".into()))
        );
        assert_eq!(alpaca.rules[0].outcome, RuleOutcome::Duplicate);
        assert!(
            !alpaca.rules[0].note.contains("{key}")
                || alpaca.rules[0].note.contains("client_order_id={key}")
        );
    }
}
