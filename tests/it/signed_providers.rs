//! Signed providers through the real binary, against fakes that check every signature the
//! way the provider documents it (tests/common/fakes/signed.rs): AWS SES v2 (SigV4, driven by
//! boto3 in a new process per run), Binance (HMAC over query + body, `recvWindow`), Kraken
//! (HMAC-SHA512, increasing nonces, errors inside HTTP 200) and Coinbase Advanced Trade (an
//! ES256 JWT per request).
//!
//! A re-run of a tool signs again: new timestamp, nonce, JWT, `X-Amz-Date`. The profiles make
//! such a re-run the same operation (one email, one order), keep two accounts apart, and never
//! change a signed byte: each fake counts the requests it refused, and every test asserts
//! there were none (or exactly the ones it provoked).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::common::client::{send, Reply};
use crate::common::fakes::signed::{
    binance_sign, encode_form, kraken_sign, now_ms, parse_amz_date, Binance, Coinbase,
    CoinbaseBehavior, CoinbaseKey, Fake, Kraken, KrakenBehavior, Ses, SES_HOST,
};
use crate::common::pki::{self, ProxyCa, TestPki};
use crate::common::proxy::{config, route, Proxy, StoreFixture};
use crate::common::{eventually, Backend};
use base64::Engine;
use sha2::{Digest, Sha256};

fn assert_problem(r: &Reply, status: u16, slug: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.header("x-idemproxy-error"), Some(slug), "{}", r.text());
    assert_eq!(
        r.json()["type"],
        format!("urn:idemproxy:problem:{slug}"),
        "{}",
        r.text()
    );
}

// ---------------------------------------------------------------------------------------
// a. AWS SES v2 with boto3 through HTTPS_PROXY.

const AKID_A: &str = "AKIAFAKEAAAAAAAAAAAA";
const AKID_B: &str = "AKIAFAKEBBBBBBBBBBBB";
const AWS_SECRET_A: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEYA";
const AWS_SECRET_B: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEYB";

/// One `sesv2.send_email` in a new Python process, as a tool run would make it. Prints the
/// status, MessageId (or error) and response headers as one JSON line.
const BOTO3_SEND_EMAIL: &str = r#"
import json, sys
import boto3, botocore.exceptions
from botocore.config import Config

a = json.loads(sys.argv[1])
client = boto3.client(
    "sesv2",
    region_name="us-east-1",
    aws_access_key_id=a["key_id"],
    aws_secret_access_key=a["secret"],
    endpoint_url=a.get("endpoint_url"),
    config=Config(connect_timeout=10, read_timeout=20),
)
if a.get("key"):
    # Signed with the rest: SigV4 covers every header present when it signs.
    def add_key(request, **kwargs):
        request.headers["Idempotency-Key"] = a["key"]
    client.meta.events.register("before-sign.sesv2.SendEmail", add_key)
signed = {}
def note_signature(request, **kwargs):
    signed["at"] = request.headers["X-Amz-Date"].decode()
    signed["authorization"] = request.headers["Authorization"].decode()
client.meta.events.register("before-send.sesv2.SendEmail", note_signature)
try:
    r = client.send_email(
        FromEmailAddress="agent@example.com",
        Destination={"ToAddresses": [a["to"]]},
        Content={"Simple": {
            "Subject": {"Data": "Your invoice"},
            "Body": {"Text": {"Data": "Invoice 42 is attached."}},
        }},
    )
    out = {"status": r["ResponseMetadata"]["HTTPStatusCode"], "message_id": r["MessageId"],
           "headers": r["ResponseMetadata"]["HTTPHeaders"]}
except botocore.exceptions.ClientError as e:
    out = {"status": e.response["ResponseMetadata"]["HTTPStatusCode"],
           "error": e.response.get("Error", {}),
           "headers": e.response["ResponseMetadata"]["HTTPHeaders"]}
out["signed"] = signed
print(json.dumps(out))
"#;

struct SesSetup {
    fake: Fake<Ses>,
    upstream_pki: TestPki,
    ca: ProxyCa,
    proxy: Proxy,
    _store: StoreFixture,
}

impl SesSetup {
    async fn start(backend: Backend) -> SesSetup {
        let upstream_pki = TestPki::new("fake AWS CA");
        let fake = Fake::start_https(
            Ses::new(
                SES_HOST,
                "us-east-1",
                &[(AKID_A, AWS_SECRET_A), (AKID_B, AWS_SECRET_B)],
            ),
            upstream_pki.server_config(&[SES_HOST]),
        )
        .await;
        let store = StoreFixture::new(backend);
        let listen = crate::common::loopback(crate::common::free_port());
        let ca = ProxyCa::init(&format!("http://{listen}"));
        let routes = format!(
            "[[routes]]\nname = \"ses\"\nprovider = \"ses\"\nprefix = \"/ses\"\nupstream = \"https://{SES_HOST}\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = {:?}\n",
            fake.port(),
            upstream_pki.ca_path().display().to_string(),
        );
        let text = config(
            &store.url(),
            &format!(
                "{}\n{routes}\n[egress]\nallow = [\"127.0.0.1\"]\n",
                ca.tls_config("")
            ),
        )
        .replace("127.0.0.1:0", &listen.to_string());
        let proxy = Proxy::start(&text);
        SesSetup {
            fake,
            upstream_pki,
            ca,
            proxy,
            _store: store,
        }
    }

    /// A tool run: a new boto3 process that signs the request itself. `via_proxy`: through
    /// HTTPS_PROXY with the proxy's CA (AWS_CA_BUNDLE); else `endpoint_url` = the proxy's
    /// `/ses` base URL.
    async fn boto3(
        &self,
        key_id: &str,
        secret: &str,
        key: Option<&str>,
        via_proxy: bool,
    ) -> serde_json::Value {
        let mut args = serde_json::json!({
            "key_id": key_id, "secret": secret, "to": "customer@example.com", "key": key,
        });
        let mut env: Vec<(String, String)> = vec![
            ("AWS_CONFIG_FILE".into(), "/dev/null".into()),
            ("AWS_SHARED_CREDENTIALS_FILE".into(), "/dev/null".into()),
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ];
        if via_proxy {
            env.extend(self.ca.worker_env());
            env.push(("AWS_CA_BUNDLE".into(), self.ca.cert.display().to_string()));
        } else {
            args["endpoint_url"] = self.proxy.url("/ses").into();
        }
        let out = tokio::process::Command::new("python3")
            .arg("-c")
            .arg(BOTO3_SEND_EMAIL)
            .arg(args.to_string())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", std::env::var("HOME").unwrap_or_default())
            .envs(env)
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(60), out)
            .await
            .expect("boto3 finished within 60 s")
            .expect("run python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "boto3 failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(stdout.trim()).expect("one JSON line")
    }

    fn emails(&self) -> usize {
        self.fake.with(|s| s.emails.len())
    }
}

async fn ses_rerun_in_a_new_boto3_process_sends_one_email(backend: Backend) {
    let s = SesSetup::start(backend).await;
    let first = s
        .boto3(AKID_A, AWS_SECRET_A, Some("invoice-42-email"), true)
        .await;
    assert_eq!(first["status"], 200, "{first}");
    assert_eq!(first["headers"]["idempotent-replayed"], "false", "{first}");
    // A re-run of the tool: a new process signs again, in a later second (a new X-Amz-Date,
    // so a new signature).
    let signed_at =
        parse_amz_date(first["signed"]["at"].as_str().expect("X-Amz-Date")).expect("an X-Amz-Date");
    eventually("a later second", Duration::from_secs(3), || {
        (now_ms() / 1000 > signed_at).then_some(())
    })
    .await;
    let rerun = s
        .boto3(AKID_A, AWS_SECRET_A, Some("invoice-42-email"), true)
        .await;
    assert_eq!(rerun["status"], 200, "{rerun}");
    assert_eq!(rerun["headers"]["idempotent-replayed"], "true", "{rerun}");
    assert_eq!(
        rerun["message_id"], first["message_id"],
        "the first MessageId"
    );
    assert_ne!(rerun["signed"]["at"], first["signed"]["at"]);
    assert_ne!(
        rerun["signed"]["authorization"],
        first["signed"]["authorization"]
    );
    assert_eq!(s.emails(), 1, "one email for two runs");
    assert_eq!(s.fake.received().len(), 1, "the re-run never reached SES");
    assert!(s.fake.refusals().is_empty(), "{:?}", s.fake.refusals());
    let seen = &s.fake.received()[0];
    assert_eq!(
        seen.header("idempotency-key"),
        Some("invoice-42-email"),
        "a signed header stays: removing it would break the signature"
    );
    assert!(
        seen.header("authorization")
            .is_some_and(|a| a.contains("idempotency-key;")),
        "boto3 signed the key header: {:?}",
        seen.header("authorization")
    );

    // Another access key id, same key and body: another account, another email.
    let other = s
        .boto3(AKID_B, AWS_SECRET_B, Some("invoice-42-email"), true)
        .await;
    assert_eq!(other["status"], 200, "{other}");
    assert_eq!(other["headers"]["idempotent-replayed"], "false", "{other}");
    assert_ne!(other["message_id"], first["message_id"]);
    assert_eq!(s.emails(), 2);
    let senders: Vec<String> = s
        .fake
        .with(|f| f.emails.iter().map(|e| e.access_key_id.clone()).collect());
    assert_eq!(senders, [AKID_A, AKID_B]);

    // Base-URL mode: boto3 signs for the proxy's host, which SES would refuse; the proxy
    // refuses it first, before claiming or forwarding anything.
    let base_url = s
        .boto3(AKID_A, AWS_SECRET_A, Some("invoice-43-email"), false)
        .await;
    assert_eq!(base_url["status"], 400, "{base_url}");
    assert_eq!(
        base_url["headers"]["x-idemproxy-error"], "signed-request",
        "{base_url}"
    );
    assert_eq!(s.emails(), 2, "no email");
    assert_eq!(s.fake.received().len(), 2, "SES was never called");
    assert!(s.fake.refusals().is_empty(), "{:?}", s.fake.refusals());

    // The fake's check is real: boto3's own request, with one body byte changed, is refused.
    let mut tampered = s.fake.received()[0].clone();
    let body = String::from_utf8_lossy(&tampered.body).replace("Invoice 42", "Invoice 43");
    tampered.body = body.into();
    let client = pki::client_config(&s.upstream_pki.ca_path(), &[b"http/1.1"]);
    let tcp = tokio::net::TcpStream::connect(s.fake.addr)
        .await
        .expect("connect to the fake");
    let (tls, _) = crate::common::connect::tls_over(tcp, SES_HOST, client)
        .await
        .expect("TLS to the fake");
    let headers: Vec<(String, String)> = tampered
        .headers
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "host" | "content-length"))
        .map(|(n, v)| (n.to_string(), v.to_str().expect("ASCII").to_string()))
        .collect();
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let r = crate::common::client::exchange(
        tls,
        "POST",
        &tampered.path,
        SES_HOST,
        &headers,
        tampered.body.clone(),
    )
    .await
    .expect("direct request");
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        r.header("x-amzn-errortype"),
        Some("InvalidSignatureException")
    );
    assert_eq!(s.emails(), 2);
}

// ---------------------------------------------------------------------------------------
// Binance spot.

const BN_KEY_A: &str = "vmPUZE6mv9SD5VNHk4HlWFsOr6aKE2zvsw0MuIgwCIPy6utIco14y7Ju91duEh8A";
const BN_SECRET_A: &str = "NhqPtmdSJYdKjVHjA7PZj4Mge3R5YNiP1e3UZjInClVN65XAbvqqM6A7H5fATj0j";
const BN_KEY_B: &str = "bBbPUZE6mv9SD5VNHk4HlWFsOr6aKE2zvsw0MuIgwCIPy6utIco14y7Ju91duEh8B";
const BN_SECRET_B: &str = "bBhqPtmdSJYdKjVHjA7PZj4Mge3R5YNiP1e3UZjInClVN65XAbvqqM6A7H5fATj0B";

/// What a Binance client put on the wire.
struct Sent {
    query: String,
    body: String,
}

/// A signed Binance request as its docs say: `timestamp` added where the caller put the
/// `"<ts>"` placeholder, HMAC-SHA256 hex over the query string concatenated with the body,
/// `signature` appended last (to the body, or to the query when there is no body).
async fn binance(
    proxy: &Proxy,
    route: &str,
    method: &str,
    (api_key, secret): (&str, &str),
    query: &[(&str, &str)],
    body: &[(&str, &str)],
    extra: &[(&str, &str)],
) -> (Reply, Sent) {
    let ts = now_ms().to_string();
    let fill = |pairs: &[(&str, &str)]| -> String {
        let pairs: Vec<(&str, String)> = pairs
            .iter()
            .map(|(k, v)| {
                (
                    *k,
                    if *v == "<ts>" {
                        ts.clone()
                    } else {
                        v.to_string()
                    },
                )
            })
            .collect();
        encode_form(&pairs)
    };
    let mut q = fill(query);
    let mut b = fill(body);
    let signature = binance_sign(secret, &format!("{q}{b}"));
    if b.is_empty() {
        q = if q.is_empty() {
            format!("signature={signature}")
        } else {
            format!("{q}&signature={signature}")
        };
    } else {
        b = format!("{b}&signature={signature}");
    }
    let mut headers = vec![
        ("x-mbx-apikey", api_key),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    headers.extend_from_slice(extra);
    let target = format!("http://{route}.test/api/v3/order?{q}");
    let r = send(proxy.addr, method, &target, &headers, b.clone())
        .await
        .unwrap_or_else(|e| panic!("{method} {target}: {e}"));
    (r, Sent { query: q, body: b })
}

/// A limit order, its parameters split between the query and the body.
async fn limit_order(
    proxy: &Proxy,
    route: &str,
    account: (&str, &str),
    client_order_id: &str,
    extra: &[(&str, &str)],
) -> (Reply, Sent) {
    binance(
        proxy,
        route,
        "POST",
        account,
        &[("symbol", "BTCUSDT"), ("side", "BUY"), ("type", "LIMIT")],
        &[
            ("timeInForce", "GTC"),
            ("quantity", "0.01"),
            ("price", "50000"),
            ("newClientOrderId", client_order_id),
            ("recvWindow", "5000"),
            ("timestamp", "<ts>"),
        ],
        extra,
    )
    .await
}

/// The same order re-signed by a re-run: new timestamp, another recvWindow, the parameters
/// in another order, `price` moved from the body to the query.
async fn limit_order_resigned(
    proxy: &Proxy,
    route: &str,
    account: (&str, &str),
    client_order_id: &str,
    extra: &[(&str, &str)],
) -> (Reply, Sent) {
    binance(
        proxy,
        route,
        "POST",
        account,
        &[("price", "50000"), ("type", "LIMIT"), ("symbol", "BTCUSDT")],
        &[
            ("timestamp", "<ts>"),
            ("newClientOrderId", client_order_id),
            ("side", "BUY"),
            ("recvWindow", "10000"),
            ("quantity", "0.01"),
            ("timeInForce", "GTC"),
        ],
        extra,
    )
    .await
}

fn binance_route(fake: &Fake<Binance>, extra: &str) -> String {
    route(
        "binance",
        fake.port(),
        &format!("provider = \"binance\"\n{extra}"),
    )
}

/// The fake got exactly these bytes, and accepted every signature it got.
fn assert_untouched(fake: &Fake<Binance>, sent: &[&Sent]) {
    let got = fake.received();
    assert_eq!(got.len(), sent.len(), "requests that reached Binance");
    for (g, s) in got.iter().zip(sent) {
        assert_eq!(g.query, s.query, "query as signed");
        assert_eq!(g.body, s.body.as_bytes(), "body as signed");
    }
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

async fn binance_resigned_order_is_placed_once(backend: Backend) {
    let fake = Fake::start(Binance::new(&[
        (BN_KEY_A, BN_SECRET_A),
        (BN_KEY_B, BN_SECRET_B),
    ]))
    .await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &binance_route(&fake, "")));
    let a = (BN_KEY_A, BN_SECRET_A);

    // Keyed by the client's own newClientOrderId (no Idempotency-Key header).
    let (first, sent) = limit_order(&proxy, "binance", a, "agent-7f3a-1", &[]).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.replayed(), Some("false"));
    assert_eq!(first.json()["clientOrderId"], "agent-7f3a-1");
    let (retry, resent) = limit_order_resigned(&proxy, "binance", a, "agent-7f3a-1", &[]).await;
    assert_ne!(sent.body, resent.body, "signed again, differently");
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert_eq!(retry.replayed(), Some("true"));
    assert_eq!(retry.body, first.body, "the first order's bytes");
    assert_eq!(fake.with(|b| b.orders.len()), 1, "one order");
    assert_untouched(&fake, &[&sent]);

    // With an Idempotency-Key too: the same.
    let key = [("idempotency-key", "rebalance-2026-11-30")];
    let (first_k, sent_k) = limit_order(&proxy, "binance", a, "agent-7f3a-2", &key).await;
    let (retry_k, _) = limit_order_resigned(&proxy, "binance", a, "agent-7f3a-2", &key).await;
    assert_eq!((first_k.status, first_k.replayed()), (200, Some("false")));
    assert_eq!((retry_k.status, retry_k.replayed()), (200, Some("true")));
    assert_eq!(retry_k.body, first_k.body);
    assert_eq!(fake.with(|b| b.orders.len()), 2);

    // Another API key, everything else the same: another account, another order.
    let (other, sent_b) = limit_order(
        &proxy,
        "binance",
        (BN_KEY_B, BN_SECRET_B),
        "agent-7f3a-1",
        &[],
    )
    .await;
    assert_eq!(other.status, 200, "{}", other.text());
    assert_eq!(other.replayed(), Some("false"));
    assert_ne!(other.body, first.body);
    let keys: Vec<String> = fake.with(|b| b.orders.iter().map(|o| o.api_key.clone()).collect());
    assert_eq!(keys, [BN_KEY_A, BN_KEY_A, BN_KEY_B]);
    assert_untouched(&fake, &[&sent, &sent_k, &sent_b]);
}

async fn binance_duplicate_answer_is_held_never_replayed(backend: Backend) {
    let fake = Fake::start(Binance::new(&[(BN_KEY_A, BN_SECRET_A)])).await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(&store.url(), &binance_route(&fake, "")));
    let a = (BN_KEY_A, BN_SECRET_A);
    // An earlier run placed this order without the proxy; it is still open.
    fake.with(|b| b.place_directly(BN_KEY_A, "BTCUSDT", "agent-dup-1"));

    let (first, sent) = limit_order(&proxy, "binance", a, "agent-dup-1", &[]).await;
    assert_problem(&first, 409, "outcome-unknown");
    let detail = first.json()["detail"].as_str().unwrap_or("").to_string();
    assert!(
        detail.contains("origClientOrderId=agent-dup-1"),
        "names the lookup: {detail}"
    );
    assert_untouched(&fake, &[&sent]);

    // The retry is held: not sent, and Binance's -2010 answer is never replayed as a receipt.
    let (retry, _) = limit_order_resigned(&proxy, "binance", a, "agent-dup-1", &[]).await;
    assert_problem(&retry, 409, "outcome-unknown");
    assert!(!retry.text().contains("-2010"), "{}", retry.text());
    assert_eq!(fake.received().len(), 1, "the retry was not sent");
    assert_eq!(fake.with(|b| b.orders.len()), 1, "no second order");

    // The lookup the detail names, signed, through the proxy (a GET passes through).
    let (lookup, _) = binance(
        &proxy,
        "binance",
        "GET",
        a,
        &[
            ("symbol", "BTCUSDT"),
            ("origClientOrderId", "agent-dup-1"),
            ("timestamp", "<ts>"),
        ],
        &[],
        &[],
    )
    .await;
    assert_eq!(lookup.status, 200, "{}", lookup.text());
    assert_eq!(lookup.json()["clientOrderId"], "agent-dup-1");
    assert_eq!(lookup.json()["status"], "NEW");
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

const TENANT_SECRET: &str = "team-a-pw-5be1";

fn tenant_auth() -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("team-a:{TENANT_SECRET}"))
    )
}

async fn binance_signed_orders_in_a_tenant_need_its_prefix() {
    let fake = Fake::start(Binance::new(&[(BN_KEY_A, BN_SECRET_A)])).await;
    let store = StoreFixture::new(Backend::Sqlite);
    let tenants = format!(
        "[[tenants]]\nname = \"team-a\"\nsecret_sha256 = \"{}\"\n",
        hex::encode(Sha256::digest(TENANT_SECRET.as_bytes()))
    );
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &(binance_route(&fake, "") + &tenants),
    ));
    let a = (BN_KEY_A, BN_SECRET_A);
    let auth = tenant_auth();
    let as_tenant = [("proxy-authorization", auth.as_str())];

    // The proxy cannot put the tenant into a signed newClientOrderId, so it refuses.
    let (bare, _) = limit_order(&proxy, "binance", a, "agent-1", &as_tenant).await;
    assert_problem(&bare, 400, "signed-request");
    assert!(fake.received().is_empty(), "nothing reached Binance");

    // With the tenant's prefix it goes through untouched, and verifies.
    let (first, sent) = limit_order(&proxy, "binance", a, "team-a-agent-1", &as_tenant).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let (retry, _) = limit_order_resigned(&proxy, "binance", a, "team-a-agent-1", &as_tenant).await;
    assert_eq!((retry.replayed(), &retry.body), (Some("true"), &first.body));
    assert_eq!(fake.with(|b| b.orders.len()), 1);
    assert_untouched(&fake, &[&sent]);
    assert!(fake
        .received()
        .iter()
        .all(|r| r.header("proxy-authorization").is_none()));

    // A duplicate answer names the id Binance has: the client's own, never a key the proxy
    // would have passed down (nothing is passed down into a signed body).
    fake.with(|b| b.place_directly(BN_KEY_A, "BTCUSDT", "team-a-dup-1"));
    let (dup, _) = limit_order(&proxy, "binance", a, "team-a-dup-1", &as_tenant).await;
    assert_problem(&dup, 409, "outcome-unknown");
    let detail = dup.json()["detail"].as_str().unwrap_or("").to_string();
    assert!(
        detail.contains("origClientOrderId=team-a-dup-1"),
        "names the id Binance has: {detail}"
    );
}

/// Finding 3: without the profile nothing in the request says that a re-signed order is the
/// same order, so it executes twice (market orders fill at once, which frees their
/// `newClientOrderId` at Binance). The profile on another route to the same fake makes it one.
async fn binance_without_the_profile_a_resigned_order_runs_twice() {
    let mut binance = Binance::new(&[(BN_KEY_A, BN_SECRET_A)]);
    binance.fill_at_once = true;
    let fake = Fake::start(binance).await;
    let store = StoreFixture::new(Backend::Sqlite);
    let routes = route("plain", fake.port(), "") + &binance_route(&fake, "");
    let proxy = Proxy::in_process(&config(&store.url(), &routes));
    let a = (BN_KEY_A, BN_SECRET_A);

    let (first, _) = limit_order(&proxy, "plain", a, "agent-mkt-1", &[]).await;
    let (again, _) = limit_order_resigned(&proxy, "plain", a, "agent-mkt-1", &[]).await;
    assert_eq!((first.status, again.status), (200, 200), "{}", again.text());
    assert_eq!(again.replayed(), None, "not protected: {:?}", again.headers);
    assert!(again.header("x-idemproxy-warning").is_some());
    assert_ne!(first.body, again.body);
    assert_eq!(
        fake.with(|b| b.orders.len()),
        2,
        "without the profile: twice"
    );

    // With an Idempotency-Key but no profile, the re-signed retry is another request under
    // the same key (its timestamp and signature differ): refused, not replayed.
    let key = [("idempotency-key", "agent-mkt-2")];
    let (keyed, _) = limit_order(&proxy, "plain", a, "agent-mkt-2", &key).await;
    let (keyed_again, _) = limit_order_resigned(&proxy, "plain", a, "agent-mkt-2", &key).await;
    assert_eq!(keyed.status, 200);
    assert_problem(&keyed_again, 422, "idempotency-key-reused");
    assert_eq!(fake.with(|b| b.orders.len()), 3);

    let (p1, _) = limit_order(&proxy, "binance", a, "agent-mkt-3", &[]).await;
    let (p2, _) = limit_order_resigned(&proxy, "binance", a, "agent-mkt-3", &[]).await;
    assert_eq!((p1.status, p2.replayed()), (200, Some("true")));
    assert_eq!(p2.body, p1.body);
    assert_eq!(fake.with(|b| b.orders.len()), 4, "with the profile: once");
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

// ---------------------------------------------------------------------------------------
// Kraken.

const KR_KEY: &str = "kQH5HW/8p1uGOVjbgWA7FunAmGO8lsSUXNsu3eow76sz84Q18fWxnyRzBHCd3pd5";

fn kraken_secret() -> String {
    base64::engine::general_purpose::STANDARD.encode([0x5au8; 64])
}

/// Increasing nonces, as a client keeps them (here: shared by every "run").
static NONCE: AtomicU64 = AtomicU64::new(0);

fn next_nonce() -> u64 {
    let now = now_ms() * 1000;
    NONCE.fetch_max(now, Ordering::SeqCst);
    NONCE.fetch_add(1, Ordering::SeqCst) + 1
}

/// AddOrder as Kraken's docs sign it: `nonce` first in the form body, `API-Sign` over the
/// path and SHA256(nonce + body).
async fn kraken_order(proxy: &Proxy, nonce: u64, params: &[(&str, &str)]) -> Reply {
    let nonce = nonce.to_string();
    let mut pairs: Vec<(&str, String)> = vec![("nonce", nonce.clone())];
    pairs.extend(params.iter().map(|(k, v)| (*k, v.to_string())));
    let body = encode_form(&pairs);
    let path = "/0/private/AddOrder";
    let sign = kraken_sign(&kraken_secret(), path, &nonce, &body);
    let headers = [
        ("api-key", KR_KEY),
        ("api-sign", sign.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    send(
        proxy.addr,
        "POST",
        &format!("http://kraken.test{path}"),
        &headers,
        body,
    )
    .await
    .expect("AddOrder")
}

fn kraken_params(cl_ord_id: &str) -> Vec<(&str, &str)> {
    vec![
        ("ordertype", "limit"),
        ("type", "buy"),
        ("volume", "1.25"),
        ("pair", "XBTUSD"),
        ("price", "27500.0"),
        ("cl_ord_id", cl_ord_id),
    ]
}

async fn kraken_start(backend: Backend) -> (Fake<Kraken>, Proxy, StoreFixture) {
    let fake = Fake::start(Kraken::new(&[(KR_KEY, &kraken_secret())])).await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("kraken", fake.port(), "provider = \"kraken\""),
    ));
    (fake, proxy, store)
}

async fn kraken_resigned_order_is_placed_once(backend: Backend) {
    let (fake, proxy, _store) = kraken_start(backend).await;
    let params = kraken_params("run-7f3a-1");
    let first = kraken_order(&proxy, next_nonce(), &params).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(
        first.json()["error"],
        serde_json::json!([]),
        "{}",
        first.text()
    );
    assert_eq!(first.replayed(), Some("false"));
    assert_eq!(
        first.json()["result"]["txid"][0].as_str(),
        fake.with(|k| k.orders.first().map(|o| o.txid.clone()))
            .as_deref(),
        "the client got Kraken's own order id"
    );
    // A re-run: a new nonce and signature, the fields in another order.
    let mut reordered = params.clone();
    reordered.reverse();
    let rerun = kraken_order(&proxy, next_nonce(), &reordered).await;
    assert_eq!(rerun.replayed(), Some("true"), "{}", rerun.text());
    assert_eq!(rerun.body, first.body);
    assert_eq!(fake.with(|k| k.orders.len()), 1, "one order");
    assert_eq!(fake.received().len(), 1);
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());

    // A stale nonce is refused before execution (EAPI:Invalid nonce): the claim is released
    // and the re-signed retry executes.
    let stale = kraken_order(&proxy, 1, &kraken_params("run-7f3a-2")).await;
    assert_eq!(
        stale.json()["error"][0],
        "EAPI:Invalid nonce",
        "{}",
        stale.text()
    );
    let fresh = kraken_order(&proxy, next_nonce(), &kraken_params("run-7f3a-2")).await;
    assert_eq!(fresh.replayed(), Some("false"), "{}", fresh.text());
    assert_eq!(
        fresh.json()["error"],
        serde_json::json!([]),
        "{}",
        fresh.text()
    );
    assert_eq!(fake.with(|k| k.orders.len()), 2);
    assert_eq!(fake.refusals(), ["EAPI:Invalid nonce"]);
}

async fn kraken_errors_inside_200_are_held_or_kept(backend: Backend) {
    let (fake, proxy, _store) = kraken_start(backend).await;

    // Busy after the order was placed: it may exist, so the retry is held, not sent.
    fake.with(|k| k.then([KrakenBehavior::BusyAfterEffect]));
    let busy = kraken_order(&proxy, next_nonce(), &kraken_params("busy-1")).await;
    assert_eq!(busy.status, 200, "{}", busy.text());
    assert_eq!(
        busy.json()["error"][0],
        "EService:Busy",
        "Kraken's own body"
    );
    let held = kraken_order(&proxy, next_nonce(), &kraken_params("busy-1")).await;
    assert_problem(&held, 409, "outcome-unknown");
    assert_eq!(fake.received().len(), 1, "the retry was not sent");
    assert_eq!(fake.with(|k| k.orders.len()), 1, "one order, never two");

    // Insufficient funds: nothing happened; the client gets Kraken's body and an identical
    // (re-signed) retry replays it without reaching Kraken.
    fake.with(|k| k.then([KrakenBehavior::InsufficientFunds]));
    let poor = kraken_order(&proxy, next_nonce(), &kraken_params("poor-1")).await;
    assert_eq!(poor.status, 200);
    assert_eq!(
        poor.json(),
        serde_json::json!({"error": ["EOrder:Insufficient funds"]})
    );
    assert_eq!(poor.replayed(), Some("false"));
    let again = kraken_order(&proxy, next_nonce(), &kraken_params("poor-1")).await;
    assert_eq!(again.replayed(), Some("true"), "{}", again.text());
    assert_eq!(again.body, poor.body);
    assert_eq!(fake.received().len(), 2, "no second request to Kraken");
    assert_eq!(fake.with(|k| k.orders.len()), 1, "not an order");
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

// ---------------------------------------------------------------------------------------
// Coinbase Advanced Trade.

const CB_PATH: &str = "/api/v3/brokerage/orders";

async fn coinbase_order(proxy: &Proxy, jwt: &str, client_order_id: &str) -> Reply {
    let body = serde_json::json!({
        "client_order_id": client_order_id,
        "product_id": "BTC-USD",
        "side": "BUY",
        "order_configuration": {"market_market_ioc": {"quote_size": "10.00"}},
    })
    .to_string();
    let auth = format!("Bearer {jwt}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    send(
        proxy.addr,
        "POST",
        &format!("http://coinbase.test{CB_PATH}"),
        &headers,
        body,
    )
    .await
    .expect("create order")
}

async fn coinbase_new_jwts_for_one_key_are_one_account(backend: Backend) {
    let k1 = CoinbaseKey::generate("organizations/org-1/apiKeys/key-1");
    let k2 = CoinbaseKey::generate("organizations/org-1/apiKeys/key-2");
    let fake = Fake::start(Coinbase::new(&[&k1, &k2])).await;
    let store = StoreFixture::new(backend);
    let proxy = Proxy::in_process(&config(
        &store.url(),
        &route("coinbase", fake.port(), "provider = \"coinbase\""),
    ));
    let jwt = |k: &CoinbaseKey| k.jwt("POST", "coinbase.test", CB_PATH);

    let (t1, t2) = (jwt(&k1), jwt(&k1));
    assert_ne!(t1, t2, "a new JWT per request");
    let first = coinbase_order(&proxy, &t1, "cb-run-1").await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.json()["success"], true, "{}", first.text());
    assert_eq!(first.replayed(), Some("false"));
    let rerun = coinbase_order(&proxy, &t2, "cb-run-1").await;
    assert_eq!(rerun.replayed(), Some("true"), "{}", rerun.text());
    assert_eq!(rerun.body, first.body);
    assert_eq!(
        fake.received().len(),
        1,
        "the re-run never reached Coinbase"
    );
    assert_eq!(
        fake.with(|c| c
            .orders
            .iter()
            .map(|o| o.order_id.clone())
            .collect::<Vec<_>>()),
        [first.json()["success_response"]["order_id"]
            .as_str()
            .unwrap_or_default()
            .to_string()],
        "one order, the one the client got"
    );

    // Another key name: another account, its own order.
    let other = coinbase_order(&proxy, &jwt(&k2), "cb-run-1").await;
    assert_eq!(other.replayed(), Some("false"), "{}", other.text());
    assert_ne!(
        other.json()["success_response"]["order_id"],
        first.json()["success_response"]["order_id"]
    );
    let keys: Vec<String> = fake.with(|c| c.orders.iter().map(|o| o.key_name.clone()).collect());
    assert_eq!(keys, [k1.name.clone(), k2.name.clone()]);

    // A rejection inside HTTP 200 (success: false) is kept: the re-run replays it.
    fake.with(|c| c.then([CoinbaseBehavior::InsufficientFund]));
    let poor = coinbase_order(&proxy, &jwt(&k1), "cb-run-2").await;
    assert_eq!(poor.status, 200);
    assert_eq!(poor.json()["success"], false);
    assert_eq!(poor.json()["error_response"]["error"], "INSUFFICIENT_FUND");
    let again = coinbase_order(&proxy, &jwt(&k1), "cb-run-2").await;
    assert_eq!((again.replayed(), &again.body), (Some("true"), &poor.body));
    assert_eq!(fake.received().len(), 3);
    assert_eq!(
        fake.with(|c| c.orders.len()),
        2,
        "the rejection is no order"
    );
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

// ---------------------------------------------------------------------------------------
// The fakes refuse what their providers refuse (no proxy involved).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fakes_refuse_what_their_providers_refuse() {
    // Binance: a good order, then one changed after signing, one with a stale timestamp,
    // one with an unknown key.
    let fake = Fake::start(Binance::new(&[(BN_KEY_A, BN_SECRET_A)])).await;
    let direct = |q: String, key: &'static str| {
        let addr = fake.addr;
        async move {
            send(
                addr,
                "POST",
                &format!("http://binance.test/api/v3/order?{q}"),
                &[("x-mbx-apikey", key)],
                "",
            )
            .await
            .expect("direct order")
        }
    };
    let signed = |params: String| {
        let sig = binance_sign(BN_SECRET_A, &params);
        format!("{params}&signature={sig}")
    };
    let params = |ts: u64, qty: &str| {
        format!("symbol=BTCUSDT&side=BUY&type=MARKET&quantity={qty}&timestamp={ts}")
    };
    let ok = direct(signed(params(now_ms(), "1")), BN_KEY_A).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let tampered = signed(params(now_ms(), "1")).replace("quantity=1", "quantity=9");
    let r = direct(tampered, BN_KEY_A).await;
    assert_eq!((r.status, r.json()["code"].as_i64()), (401, Some(-1022)));
    let r = direct(signed(params(now_ms() - 6000, "1")), BN_KEY_A).await;
    assert_eq!((r.status, r.json()["code"].as_i64()), (400, Some(-1021)));
    let r = direct(signed(params(now_ms(), "1")), "unknown-key").await;
    assert_eq!((r.status, r.json()["code"].as_i64()), (401, Some(-2015)));
    assert_eq!(fake.with(|b| b.orders.len()), 1);
    assert_eq!(fake.refusals().len(), 3);

    // Kraken: a signature over another body; a nonce that does not increase.
    let kraken = Fake::start(Kraken::new(&[(KR_KEY, &kraken_secret())])).await;
    let add = |nonce: u64, signed_body: String, sent_body: String| {
        let addr = kraken.addr;
        async move {
            let sign = kraken_sign(
                &kraken_secret(),
                "/0/private/AddOrder",
                &nonce.to_string(),
                &signed_body,
            );
            send(
                addr,
                "POST",
                "http://kraken.test/0/private/AddOrder",
                &[
                    ("api-key", KR_KEY),
                    ("api-sign", &sign),
                    ("content-type", "application/x-www-form-urlencoded"),
                ],
                sent_body,
            )
            .await
            .expect("direct AddOrder")
        }
    };
    let body =
        |n: u64, vol: &str| format!("nonce={n}&ordertype=market&type=buy&volume={vol}&pair=XBTUSD");
    let n = next_nonce();
    let ok = add(n, body(n, "1"), body(n, "1")).await;
    assert_eq!(ok.json()["error"], serde_json::json!([]), "{}", ok.text());
    let n2 = next_nonce();
    let r = add(n2, body(n2, "1"), body(n2, "9")).await;
    assert_eq!(r.json()["error"][0], "EAPI:Invalid signature");
    let r = add(n, body(n, "1"), body(n, "1")).await;
    assert_eq!(
        r.json()["error"][0],
        "EAPI:Invalid nonce",
        "a replayed nonce"
    );
    assert_eq!(kraken.with(|k| k.orders.len()), 1);
    assert_eq!(kraken.refusals().len(), 2);

    // Coinbase: a JWT signed by another key under this key's name, one for another path,
    // and one whose claims were changed after signing.
    let k1 = CoinbaseKey::generate("organizations/org-1/apiKeys/key-1");
    let impostor = CoinbaseKey::generate("organizations/org-1/apiKeys/key-1");
    let coinbase = Fake::start(Coinbase::new(&[&k1])).await;
    let order = |jwt: String| {
        let addr = coinbase.addr;
        async move {
            let auth = format!("Bearer {jwt}");
            send(
                addr,
                "POST",
                &format!("http://coinbase.test{CB_PATH}"),
                &[
                    ("authorization", auth.as_str()),
                    ("content-type", "application/json"),
                ],
                r#"{"client_order_id":"x-1","product_id":"BTC-USD","side":"BUY"}"#,
            )
            .await
            .expect("direct order")
        }
    };
    let ok = order(k1.jwt("POST", "coinbase.test", CB_PATH)).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    for bad in [
        impostor.jwt("POST", "coinbase.test", CB_PATH),
        k1.jwt(
            "POST",
            "coinbase.test",
            "/api/v3/brokerage/orders/batch_cancel",
        ),
        {
            let t = k1.jwt("POST", "coinbase.test", CB_PATH);
            let parts: Vec<&str> = t.split('.').collect();
            let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            let mut claims: HashMap<String, serde_json::Value> =
                serde_json::from_slice(&engine.decode(parts[1]).expect("b64")).expect("claims");
            claims.insert("exp".into(), (now_ms() / 1000 + 3600).into());
            let forged = engine.encode(serde_json::to_vec(&claims).expect("json"));
            format!("{}.{forged}.{}", parts[0], parts[2])
        },
    ] {
        let r = order(bad).await;
        assert_eq!(r.status, 401, "{}", r.text());
        assert_eq!(r.json()["error"], "UNAUTHENTICATED");
    }
    assert_eq!(coinbase.refusals().len(), 3, "{:?}", coinbase.refusals());
    assert_eq!(coinbase.with(|c| c.orders.len()), 1);
}

both_backends!(
    ses_rerun_in_a_new_boto3_process_sends_one_email,
    binance_resigned_order_is_placed_once,
    binance_duplicate_answer_is_held_never_replayed,
    kraken_resigned_order_is_placed_once,
    kraken_errors_inside_200_are_held_or_kept,
    coinbase_new_jwts_for_one_key_are_one_account,
);

mod single {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn binance_signed_orders_in_a_tenant_need_its_prefix() {
        super::binance_signed_orders_in_a_tenant_need_its_prefix().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn binance_without_the_profile_a_resigned_order_runs_twice() {
        super::binance_without_the_profile_a_resigned_order_runs_twice().await
    }
}
