//! Every shipped example covers each provider it routes on every other host that provider's
//! SDK or agent toolkit sends side effects to (an MCP server, uploads, another region), or the
//! proxy refuses a CONNECT there: a worker on `HTTPS_PROXY` never reaches such a host through a
//! blind tunnel. The hosts are listed here from the SDKs themselves, not from the proxy's
//! profiles, so a profile that forgets one fails this test.

use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::pki::TestPki;
use crate::common::worker::{repo, Worker};

/// Per provider profile: the hosts besides the routed API where its official SDK or agent
/// toolkit sends requests that change something, and where that was read.
const SECOND_HOSTS: &[(&str, &[&str], &str)] = &[
    (
        "stripe",
        &[
            "mcp.stripe.com",
            "files.stripe.com",
            "connect.stripe.com",
            "meter-events.stripe.com",
        ],
        "stripe-agent-toolkit 0.7.0 shared/constants.py (MCP_SERVER_URL, its only host); \
         stripe-python 16.1.0 stripe/__init__.py (DEFAULT_UPLOAD_API_BASE, \
         DEFAULT_CONNECT_API_BASE, DEFAULT_METER_EVENTS_API_BASE)",
    ),
    (
        "sendgrid",
        &["api.eu.sendgrid.com"],
        "sendgrid-python 6.12.5 base_interface.py (region_host_dict, data residency eu)",
    ),
    (
        "mailgun",
        &["api.eu.mailgun.net"],
        "Mailgun's EU region API (mailgun 1.10.0 takes the base host as a setting)",
    ),
    ("postmark", &[], "postmarker 1.0: api.postmarkapp.com only"),
    ("resend", &[], "resend 2.52.0: api.resend.com only"),
    (
        "ses",
        &["email.eu-west-1.amazonaws.com"],
        "boto3 1.44.8 sesv2: email.{region}.amazonaws.com, the region from the environment",
    ),
    (
        "twilio",
        &[
            "verify.twilio.com",
            "messaging.twilio.com",
            "conversations.twilio.com",
            "api.dublin.ie1.twilio.com",
        ],
        "twilio-python 9.13.0 rest/*/__init__.py (a host per product), \
         base/client_base.py get_hostname (edge and region hosts)",
    ),
    (
        "alpaca",
        &[
            "api.alpaca.markets",
            "paper-api.alpaca.markets",
            "broker-api.alpaca.markets",
        ],
        "alpaca-py 0.44.0 common/enums.py BaseURL (TRADING_LIVE, TRADING_PAPER, BROKER_PRODUCTION)",
    ),
];

const TENANT: (&str, &str) = ("hosts-check", "hosts-check-secret");

/// The status and body of the proxy's answer to `CONNECT authority`, as the tenant.
async fn connect_status(proxy: std::net::SocketAddr, authority: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(proxy)
        .await
        .expect("connect");
    let auth =
        base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", TENANT.0, TENANT.1));
    let head = format!(
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            let n = stream.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if answered(&got) {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), read).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no CONNECT answer for {authority}: {text:?}"));
    (status, text)
}

/// Whether `got` holds the whole answer: its head, and the body its Content-Length gives (a
/// 200 leaves the tunnel open, its head is all there is).
fn answered(got: &[u8]) -> bool {
    let text = String::from_utf8_lossy(got);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    body.len() >= length
}

fn host_of(upstream: &str) -> String {
    let rest = upstream.split_once("://").map_or(upstream, |(_, r)| r);
    rest.split(['/', ':'])
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_example_covers_or_refuses_its_providers_other_hosts() {
    let pki = TestPki::new("provider hosts");
    let mut checked = 0;
    let mut examples: Vec<_> = std::fs::read_dir(repo("config/examples"))
        .expect("config/examples")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    examples.sort();
    for path in examples {
        let file = path
            .file_name()
            .and_then(|f| f.to_str())
            .expect("name")
            .to_string();
        let cfg: toml::Table = std::fs::read_to_string(&path)
            .expect("read")
            .parse()
            .expect("TOML");
        let routes: Vec<&toml::Table> = cfg["routes"]
            .as_array()
            .expect("routes")
            .iter()
            .filter_map(|r| r.as_table())
            .collect();
        let routed: Vec<String> = routes
            .iter()
            .filter_map(|r| r.get("upstream")?.as_str().map(host_of))
            .collect();
        let mut hosts = Vec::new();
        for provider in routes.iter().filter_map(|r| r.get("provider")?.as_str()) {
            let (_, second, _) = SECOND_HOSTS
                .iter()
                .find(|(p, _, _)| *p == provider)
                .unwrap_or_else(|| {
                    panic!("{file}: provider {provider} has no entry in SECOND_HOSTS: list the hosts its SDK reaches")
                });
            hosts.extend(second.iter().map(|h| (provider, *h)));
        }
        if hosts.is_empty() {
            continue;
        }
        // Every route's upstream CA replaced (local.toml names one in certs/), none dialled.
        let names: Vec<(&str, u16)> = routes
            .iter()
            .filter_map(|r| r.get("name")?.as_str())
            .map(|n| (n, 9))
            .collect();
        let w = Worker::start_as(
            path.file_name().and_then(|f| f.to_str()).expect("name"),
            &names,
            &pki,
            Some(TENANT),
        );
        for (provider, host) in hosts {
            let (status, answer) = connect_status(w.proxy.addr, &format!("{host}:443")).await;
            if routed.iter().any(|r| r == host) {
                assert_eq!(
                    status, 200,
                    "{file}: {host} is routed, so intercepted: {answer}"
                );
            } else {
                assert_eq!(status, 403, "{file}: {host} of {provider}: {answer}");
                assert!(
                    answer.contains("connect-provider-side-door"),
                    "{file}: {host} of {provider} refused as a side door: {answer}"
                );
            }
            checked += 1;
        }
    }
    // stripe.toml, payments-budget.toml and local.toml (4 each), email.toml, sms.toml, broker.toml.
    assert!(checked >= 20, "{checked} hosts checked");
}
