//! The promise "set the worker's environment, change no tool code", tried the way a new user
//! tries it: provider SDKs and HTTP clients as shipped, in every runtime, each tool a new
//! process (a new worker) with exactly the setup `idemproxy env` printed (plus PATH, HOME and
//! the provider's own credentials), nothing in its code naming the proxy or its CA. Each row
//! goes through the real proxy with TLS intercepted (CONNECT api.stripe.com:443 …), on a shipped
//! example config, to a fake provider that counts effects: the first run executes, the re-run
//! gets the first result, one effect.
//!
//! Where the usual variables alone (what `idemproxy ca init` prints) fail, the row shows that
//! too, so the test fails without the part of the setup it needs: stripe-python (its pinned CA
//! bundle), aiohttp (`trust_env`), stripe-node (its own https.Agent),
//! Node's fetch, Java (no variables at all), and an MCP stdio tool server (a cleaned
//! environment).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::common::fakes::accounts::{Alpaca, AlpacaKeys};
use crate::common::fakes::stripe::FakeStripe;
use crate::common::pki::{ProxyCa, TestPki};
use crate::common::provider::{FakeProvider, ProviderOptions};
use crate::common::worker::{
    env_file_lines, failed, python_script, repo, ses_account, tool, Worker,
};
use serde_json::Value;

const STRIPE_SECRET: &str = "sk_test_worker_77";
const STRIPE_HOST: &str = "api.stripe.com";

/// YAML as JSON, parsed by PyYAML (what scripts/test.sh installs).
fn yaml(text: &str) -> Value {
    use std::io::Write as _;
    let mut child = std::process::Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin.read())))",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with PyYAML");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write YAML");
    let out = child.wait_with_output().expect("python3");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("YAML does not parse ({e}):\n{text}"))
}

/// A Stripe-like fake for api.stripe.com and the shipped stripe.toml in front of it.
async fn stripe_worker() -> (FakeStripe, Worker, TestPki) {
    let pki = TestPki::new("provider CA");
    let fake = FakeStripe::start(&[STRIPE_SECRET], Some(pki.server_config(&[STRIPE_HOST]))).await;
    let worker = Worker::start("stripe.toml", &[("stripe", fake.port())], &pki);
    (fake, worker, pki)
}

/// The row: a tool run twice as two new processes pays one PaymentIntent; the re-run gets the
/// first one.
async fn pays_once(fake: &FakeStripe, w: &Worker, program: &str, args: &[&str]) -> Value {
    let creds = [("STRIPE_API_KEY", STRIPE_SECRET)];
    let first = w.run(program, args, &creds).await;
    assert!(!failed(&first), "first run failed: {first}");
    let rerun = w.run(program, args, &creds).await;
    assert!(!failed(&rerun), "the re-run failed: {rerun}");
    let id = |v: &Value| v.get("id").or_else(|| v.get("payment_intent")).cloned();
    assert!(id(&first).is_some_and(|i| i.is_string()), "{first}");
    assert_eq!(
        id(&first),
        id(&rerun),
        "the re-run gets the first PaymentIntent"
    );
    assert_eq!(fake.payment_intents(), 1, "one PaymentIntent for two runs");
    assert_eq!(fake.charges().len(), 1, "one charge for two runs");
    assert_eq!(
        w.replays("stripe").await,
        1.0,
        "the proxy replayed the re-run"
    );
    first
}

// ---------------------------------------------------------------------------------------
// Python

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_stripe_sdk_as_shipped() {
    let (fake, w, _pki) = stripe_worker().await;
    let args = [
        python_script("stripe_tool.py"),
        "pay".into(),
        "inv-py-1".into(),
        "1500".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The usual variables never reach the SDK's pinned CA bundle.
    let usual = w
        .run_with_usual_variables("python3", &args, &[("STRIPE_API_KEY", STRIPE_SECRET)])
        .await;
    assert_eq!(usual["error"], "APIConnectionError", "{usual}");
    assert!(
        usual["message"]
            .as_str()
            .is_some_and(|m| m.contains("SSL certificate")),
        "{usual}"
    );
    assert_eq!(fake.payment_intents(), 0);
    let first = pays_once(&fake, &w, "python3", &args).await;
    assert_eq!(first["status"], "succeeded");
}

/// The newer style, `StripeClient(key).v1.payment_intents.create(...)`: the same pinned bundle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_stripe_client_as_shipped() {
    let (fake, w, _pki) = stripe_worker().await;
    let script = python_script("stripe_tool.py");
    let args = [script.as_str(), "pay-client", "inv-py-client-1", "1600"];
    pays_once(&fake, &w, "python3", &args).await;
}

async fn python_http_client(client: &str) -> (FakeStripe, Worker, Value) {
    let (fake, w, _pki) = stripe_worker().await;
    let invoice = format!("inv-{client}");
    let script = python_script("http_tool.py");
    let first = pays_once(&fake, &w, "python3", &[&script, client, &invoice, "2100"]).await;
    (fake, w, first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests() {
    python_http_client("requests").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_httpx_sync() {
    python_http_client("httpx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_httpx_async() {
    python_http_client("httpx-async").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_urllib_request() {
    python_http_client("urllib").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_aiohttp() {
    let (fake, w, _first) = python_http_client("aiohttp").await;
    // Without the hook, aiohttp ignores HTTPS_PROXY and calls the provider directly.
    let script = python_script("http_tool.py");
    let usual = w
        .run_with_usual_variables(
            "python3",
            &[&script, "aiohttp", "inv-aiohttp-2", "2100"],
            &[("STRIPE_API_KEY", STRIPE_SECRET)],
        )
        .await;
    assert!(failed(&usual), "aiohttp went through the proxy: {usual}");
    assert_eq!(fake.payment_intents(), 1, "nothing reached the provider");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_boto3_ses_send_email() {
    let pki = TestPki::new("provider CA");
    let (fake, creds) = ses_account(&pki).await;
    let w = Worker::start("email.toml", &[("ses", fake.port())], &pki);
    let script = python_script("sdk_tools.py");
    let args = [script.as_str(), "ses", "Customer@Example.com", "Invoice 42"];
    // botocore reads AWS_CA_BUNDLE, and falls back to REQUESTS_CA_BUNDLE: the printed setup
    // sets both.
    assert_eq!(w.var("AWS_CA_BUNDLE"), w.var("REQUESTS_CA_BUNDLE"));
    let first = w.run("python3", &args, &creds).await;
    let rerun = w.run("python3", &args, &creds).await;
    assert!(!failed(&first) && !failed(&rerun), "{first} {rerun}");
    assert_eq!(
        first["id"], rerun["id"],
        "the re-run gets the first MessageId"
    );
    assert_eq!(rerun["replayed"], "true");
    assert_eq!(fake.with(|s| s.emails.len()), 1, "one email for two runs");
    assert!(fake.refusals().is_empty(), "{:?}", fake.refusals());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_twilio_messages_create() {
    let pki = TestPki::new("provider CA");
    let fake = FakeProvider::start_https(
        ProviderOptions::default(),
        pki.server_config(&["api.twilio.com"]),
    )
    .await;
    let w = Worker::start("sms.toml", &[("twilio", fake.port())], &pki);
    let creds = [
        ("TWILIO_ACCOUNT_SID", "ACworker0000000000000000000000000"),
        ("TWILIO_AUTH_TOKEN", "worker-auth-token"),
    ];
    let script = python_script("sdk_tools.py");
    let args = [
        script.as_str(),
        "twilio",
        "+15551230001",
        "Your order has shipped",
    ];
    let first = w.run("python3", &args, &creds).await;
    let rerun = w.run("python3", &args, &creds).await;
    assert!(!failed(&first) && !failed(&rerun), "{first} {rerun}");
    assert_eq!(fake.effects(), 1, "one message for two runs");
    assert_eq!(
        w.replays("twilio").await,
        1.0,
        "the re-run got the first answer"
    );
    let sent = &fake.effect_list()[0];
    assert_eq!(
        sent.path_and_query,
        "/2010-04-01/Accounts/ACworker0000000000000000000000000/Messages.json"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sendgrid_send() {
    let pki = TestPki::new("provider CA");
    let fake = FakeProvider::start_https(
        ProviderOptions::default(),
        pki.server_config(&["api.sendgrid.com"]),
    )
    .await;
    let w = Worker::start("email.toml", &[("sendgrid", fake.port())], &pki);
    let creds = [("SENDGRID_API_KEY", "SG.worker-key")];
    let script = python_script("sdk_tools.py");
    let args = [
        script.as_str(),
        "sendgrid",
        "ada@example.com",
        "Your invoice",
        "campaign-7",
    ];
    let first = w.run("python3", &args, &creds).await;
    let rerun = w.run("python3", &args, &creds).await;
    assert!(!failed(&first) && !failed(&rerun), "{first} {rerun}");
    assert_eq!(first["id"], rerun["id"], "the re-run gets the first answer");
    assert_eq!(rerun["replayed"], "true");
    assert_eq!(fake.effects(), 1, "one email for two runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_alpaca_submit_order() {
    let keys = AlpacaKeys {
        account: "acct-worker",
        key_id: "PKWORKER000000000000",
        secret: "worker-alpaca-secret",
    };
    let pki = TestPki::new("provider CA");
    let fake = Alpaca::start_https(&[keys], pki.server_config(&["paper-api.alpaca.markets"])).await;
    let w = Worker::start("broker.toml", &[("alpaca", fake.port())], &pki);
    let creds = [
        ("APCA_API_KEY_ID", keys.key_id),
        ("APCA_API_SECRET_KEY", keys.secret),
    ];
    let script = python_script("sdk_tools.py");
    let args = [script.as_str(), "alpaca", "rebalance-2026-07-01-aapl"];
    let first = w.run("python3", &args, &creds).await;
    let rerun = w.run("python3", &args, &creds).await;
    assert!(!failed(&first) && !failed(&rerun), "{first} {rerun}");
    assert_eq!(first["id"], rerun["id"], "the re-run gets the first order");
    assert_eq!(fake.effects(), 1, "one order for two runs");
    assert_eq!(w.replays("alpaca").await, 1.0);
}

// ---------------------------------------------------------------------------------------
// Node.js

/// The Node.js binary: `node` on PATH, or IDEMPROXY_TEST_NODE (to run the rows on another
/// version).
fn node() -> String {
    std::env::var("IDEMPROXY_TEST_NODE").unwrap_or_else(|_| "node".into())
}

fn node_tool() -> String {
    let dir = repo("tests/node");
    assert!(
        dir.join("node_modules/stripe").exists() && dir.join("node_modules/undici").exists(),
        "tests/node/node_modules is missing: scripts/test.sh installs it (npm ci in tests/node)"
    );
    dir.join("tool.mjs").display().to_string()
}

async fn node_client(client: &str) -> (FakeStripe, Worker) {
    let (fake, w, _pki) = stripe_worker().await;
    let script = node_tool();
    let invoice = format!("inv-node-{client}");
    pays_once(&fake, &w, &node(), &[&script, client, &invoice, "3100"]).await;
    (fake, w)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stripe_package_as_shipped() {
    let (fake, w) = node_client("stripe").await;
    // Its own https.Agent ignores HTTPS_PROXY: without the preload it calls Stripe directly.
    let usual = w
        .run_with_usual_variables(
            &node(),
            &[&node_tool(), "stripe", "inv-node-stripe-2", "3100"],
            &[("STRIPE_API_KEY", STRIPE_SECRET)],
        )
        .await;
    assert!(failed(&usual), "{usual}");
    assert_eq!(fake.payment_intents(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_builtin_fetch() {
    let (fake, w) = node_client("fetch").await;
    let usual = w
        .run_with_usual_variables(
            &node(),
            &[&node_tool(), "fetch", "inv-node-fetch-2", "3100"],
            &[("STRIPE_API_KEY", STRIPE_SECRET)],
        )
        .await;
    assert!(failed(&usual), "{usual}");
    assert_eq!(fake.payment_intents(), 1);
}

/// With tenants, HTTPS_PROXY carries the tenant's credentials: the preload sends them as
/// Proxy-Authorization on its CONNECT, and the proxy refuses the worker without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stripe_package_as_a_tenant() {
    let pki = TestPki::new("provider CA");
    let fake = FakeStripe::start(&[STRIPE_SECRET], Some(pki.server_config(&[STRIPE_HOST]))).await;
    let w = Worker::start_as(
        "stripe.toml",
        &[("stripe", fake.port())],
        &pki,
        Some(("agents", "tenant-secret-9")),
    );
    assert!(w
        .var("HTTPS_PROXY")
        .starts_with("http://agents:tenant-secret-9@"));
    let script = node_tool();
    pays_once(
        &fake,
        &w,
        &node(),
        &[&script, "stripe", "inv-node-tenant", "3300"],
    )
    .await;
    // The same worker with the credentials taken out of HTTPS_PROXY: refused.
    let no_credentials: Vec<(String, String)> = w
        .env
        .iter()
        .map(|(k, v)| (k.clone(), v.replace("agents:tenant-secret-9@", "")))
        .collect();
    let refused = tool(
        &node(),
        &[&script, "stripe", "inv-node-tenant-2", "3300"],
        &no_credentials,
        &[("STRIPE_API_KEY", STRIPE_SECRET)],
    )
    .await;
    assert!(failed(&refused), "{refused}");
    assert_eq!(fake.payment_intents(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_axios() {
    node_client("axios").await;
}

// ---------------------------------------------------------------------------------------
// Go, curl, Java

/// `tests/go/tool.go` built once per test run (Go's build cache under the target dir).
fn go_tool() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let bin = tmp.join("sdk-matrix-go-tool");
        let out = std::process::Command::new("go")
            .args(["build", "-o"])
            .arg(&bin)
            .arg(repo("tests/go/tool.go"))
            .env("GOCACHE", tmp.join("go-build"))
            .env("GOPATH", tmp.join("go-path"))
            .env("GO111MODULE", "off")
            .output()
            .expect("go (scripts/test.sh installs golang-go)");
        assert!(
            out.status.success(),
            "go build: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_net_http() {
    let bin = tokio::task::spawn_blocking(|| go_tool().display().to_string())
        .await
        .expect("go build");
    let (fake, w, _pki) = stripe_worker().await;
    pays_once(&fake, &w, &bin, &["inv-go-1", "4100"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_command_line() {
    let (fake, w, _pki) = stripe_worker().await;
    let script = r#"
out=$(curl -sS --max-time 30 -D "$HEADERS" -u "$STRIPE_API_KEY:" https://api.stripe.com/v1/payment_intents \
  -d amount=5100 -d currency=usd -d payment_method=pm_card_visa -d confirm=true \
  --data-urlencode 'metadata[invoice_id]=inv-curl-1') || { printf '{"error":"curl %s"}\n' "$?"; exit 0; }
replayed=$(tr -d '\r' < "$HEADERS" | sed -n 's/^[Ii]dempotent-[Rr]eplayed: //p' | tail -1)
printf '%s' "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"id": d.get("id"), "replayed": sys.argv[1]}))' "$replayed"
"#;
    let headers = tempfile::NamedTempFile::new().expect("temp file");
    let mut env = w.env.clone();
    env.push(("HEADERS".into(), headers.path().display().to_string()));
    let creds = [("STRIPE_API_KEY", STRIPE_SECRET)];
    let first = tool("sh", &["-c", script], &env, &creds).await;
    let rerun = tool("sh", &["-c", script], &env, &creds).await;
    assert!(!failed(&first) && !failed(&rerun), "{first} {rerun}");
    assert_eq!(first["id"], rerun["id"]);
    assert_eq!(rerun["replayed"], "true");
    assert_eq!(fake.payment_intents(), 1);
    assert_eq!(fake.charges().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_http_client() {
    let (fake, w, _pki) = stripe_worker().await;
    let source = repo("tests/java/Tool.java").display().to_string();
    assert!(
        w.var("JAVA_TOOL_OPTIONS").contains("trustStore="),
        "{:?}",
        w.env
    );
    // Java reads no proxy or CA variable: with the usual ones it calls Stripe directly.
    let usual = w
        .run_with_usual_variables(
            "java",
            &[&source, "inv-java-2", "6100"],
            &[("STRIPE_API_KEY", STRIPE_SECRET)],
        )
        .await;
    assert!(failed(&usual), "{usual}");
    assert_eq!(fake.payment_intents(), 0);
    pays_once(&fake, &w, "java", &[&source, "inv-java-1", "6100"]).await;
}

// ---------------------------------------------------------------------------------------
// Tools in another process: an MCP stdio server started with a cleaned environment

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_stdio_tool_server_goes_through_the_proxy_with_the_site_packages_hook() {
    let (fake, w, _pki) = stripe_worker().await;
    let server = python_script("mcp_server.py");
    let agent = python_script("mcp_agent.py");
    let creds = [("STRIPE_API_KEY", STRIPE_SECRET)];
    let args = [agent.as_str(), server.as_str(), "inv-mcp-1", "7100"];

    // With the printed environment alone, the agent's process goes through the proxy, but the
    // tool server it starts gets only HOME, PATH, SHELL, TERM, USER, LOGNAME (+ its key): its
    // call goes straight to the provider, past the proxy.
    let bypassed = w.run("python3", &args, &creds).await;
    assert!(failed(&bypassed), "{bypassed}");
    assert_eq!(fake.payment_intents(), 0, "the proxy never saw it");

    // The image step `idemproxy env` prints: the hook's .pth in the interpreter's
    // site-packages (here a venv over the system's packages), which restores the worker
    // environment from worker/worker.env in every process, cleaned or not.
    let venv = tempfile::tempdir().expect("tempdir");
    let made = tokio::process::Command::new("python3")
        .args(["-m", "venv", "--system-site-packages", "--without-pip"])
        .arg(venv.path())
        .output()
        .await
        .expect("python3 -m venv");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let python = venv.path().join("bin/python").display().to_string();
    let purelib = tool(
        &python,
        &[
            "-c",
            "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))",
        ],
        &[],
        &[],
    )
    .await;
    let pth = Path::new(w.var("PYTHONPATH")).join("idemproxy-worker.pth");
    let purelib = PathBuf::from(purelib.as_str().expect("purelib path"));
    // `python3` is the suite's own venv, and a venv made from a venv sees only the base
    // interpreter's packages: point the new one at the suite's (where `mcp` is installed).
    let suite_purelib = tool(
        "python3",
        &[
            "-c",
            "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))",
        ],
        &[],
        &[],
    )
    .await;
    let suite_purelib = suite_purelib.as_str().expect("purelib path");
    std::fs::write(
        purelib.join("suite-packages.pth"),
        format!("{suite_purelib}\n"),
    )
    .expect("point the venv at the suite's packages");
    std::os::unix::fs::symlink(&pth, purelib.join("idemproxy-worker.pth"))
        .expect("link the .pth into site-packages");
    pays_once(&fake, &w, &python, &args).await;
}

// ---------------------------------------------------------------------------------------
// What `idemproxy env` prints

#[test]
fn env_prints_every_format_and_never_touches_the_key() {
    let ca = ProxyCa::init("http://idemproxy:8080");
    let dir = ca.cert.parent().expect("CA dir").to_path_buf();
    let key_before = std::fs::read(&ca.key).expect("read key");
    let run = |format: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args([
                "env",
                "--proxy-url",
                "http://worker:s3cret@idemproxy:8080",
                "--worker-dir",
                "/etc/idemproxy/certs",
                "--format",
                format,
                "--dir",
            ])
            .arg(&dir)
            .output()
            .expect("run idemproxy env");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let env_file = run("env-file");
    let vars = env_file_lines(&env_file);
    let get = |name: &str| {
        vars.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{name} missing:\n{env_file}"))
    };
    assert_eq!(get("HTTPS_PROXY"), "http://worker:s3cret@idemproxy:8080");
    for bundle in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "AWS_CA_BUNDLE",
        "IDEMPROXY_CA_BUNDLE",
    ] {
        assert_eq!(
            get(bundle),
            "/etc/idemproxy/certs/ca-bundle.pem",
            "{bundle}"
        );
    }
    assert_eq!(get("NODE_EXTRA_CA_CERTS"), "/etc/idemproxy/certs/ca.pem");
    assert_eq!(get("PYTHONPATH"), "/etc/idemproxy/certs/worker/python");
    assert_eq!(
        get("NODE_OPTIONS"),
        "--require=/etc/idemproxy/certs/worker/node/idemproxy-worker.cjs"
    );
    assert!(get("JAVA_TOOL_OPTIONS").contains("-Dhttps.proxyHost=idemproxy -Dhttps.proxyPort=8080"));
    assert!(
        env_file.contains("Java: system properties cannot carry the proxy's credentials"),
        "{env_file}"
    );
    // The same file, written next to the CA for the hook and for `docker run --env-file`.
    let written = std::fs::read_to_string(dir.join("worker/worker.env")).expect("worker.env");
    assert_eq!(env_file_lines(&written), vars);
    for file in [
        "worker/python/idemproxy_worker.py",
        "worker/python/sitecustomize.py",
        "worker/python/idemproxy-worker.pth",
        "worker/node/idemproxy-worker.cjs",
        "worker/java/truststore.jks",
    ] {
        assert!(dir.join(file).is_file(), "{file} not written");
    }
    assert_eq!(std::fs::read(&ca.key).expect("key"), key_before);

    // Shell: export lines a shell evaluates to the same values.
    let shell = run("shell");
    let out = std::process::Command::new("sh")
        .args([
            "-c",
            &format!("{shell}\nprintf '%s' \"$JAVA_TOOL_OPTIONS\""),
        ])
        .output()
        .expect("sh");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        get("JAVA_TOOL_OPTIONS")
    );

    // Compose: an environment block and read-only mounts, never the key.
    let compose = run("compose");
    let service = yaml(&format!("service:\n{compose}"));
    let service = &service["service"];
    assert_eq!(
        service["environment"]["HTTPS_PROXY"],
        "http://worker:s3cret@idemproxy:8080"
    );
    let volumes: Vec<&str> = service["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(volumes.len(), 3, "{volumes:?}");
    assert!(volumes
        .iter()
        .all(|v| v.ends_with(":ro") && !v.contains("ca.key")));

    // worker.env holds the tenant's secret: 0600, also over one written 0644 before.
    {
        use std::os::unix::fs::PermissionsExt as _;
        let env_file = ca.cert.with_file_name("worker").join("worker.env");
        let mode = |p: &std::path::Path| {
            std::fs::metadata(p)
                .expect("worker.env")
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode(&env_file), 0o600, "{}", env_file.display());
        std::fs::set_permissions(&env_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["env", "--dir"])
            .arg(ca.cert.parent().expect("the CA's dir"))
            .args(["--proxy-url", "http://worker:s3cret@idemproxy:8080"])
            .output()
            .expect("run idemproxy env");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(mode(&env_file), 0o600, "rewritten over a 0644 file");
    }

    // No CA yet: a clear error naming the command to run first.
    let empty = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["env", "--dir"])
        .arg(empty.path())
        .output()
        .expect("run idemproxy env");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("idemproxy ca init"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// docker-compose.yml: the worker's environment and mounts are what `idemproxy env` prints for
/// it, and every call goes through the proxy because nothing else is reachable: the worker's
/// networks are internal, and the proxy is the only service with a network that is not.
#[test]
fn compose_worker_is_the_printed_setup_and_can_reach_only_the_proxy() {
    let compose =
        yaml(&std::fs::read_to_string(repo("docker-compose.yml")).expect("docker-compose.yml"));
    let ca = ProxyCa::init("http://idemproxy:8080");
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir certs");
    for file in ["ca.pem", "ca-bundle.pem"] {
        let from = ca.cert.with_file_name(file);
        std::fs::copy(&from, certs.join(file)).expect("copy the CA");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .current_dir(dir.path())
        .args([
            "env",
            "--dir",
            "certs",
            "--worker-dir",
            "/etc/idemproxy/certs",
            "--format",
            "compose",
            "--proxy-url",
            "http://worker:${IDEMPROXY_WORKER_SECRET:?set it in .env}@idemproxy:8080",
        ])
        .output()
        .expect("run idemproxy env");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = yaml(&format!(
        "worker:\n{}",
        String::from_utf8_lossy(&out.stdout)
    ));
    let worker = &compose["services"]["worker"];
    assert_eq!(worker["environment"], printed["worker"]["environment"]);
    assert_eq!(worker["volumes"], printed["worker"]["volumes"]);

    let networks = &compose["networks"];
    let internal = |name: &str| networks[name]["internal"] == Value::Bool(true);
    let names = |service: &Value| -> Vec<String> {
        service["networks"]
            .as_array()
            .unwrap_or_else(|| panic!("services list their networks: {service}"))
            .iter()
            .filter_map(|n| n.as_str().map(String::from))
            .collect()
    };
    let worker_networks = names(worker);
    assert!(!worker_networks.is_empty());
    for n in &worker_networks {
        assert!(internal(n), "the worker's network {n} has a route out");
    }
    let services = compose["services"].as_object().expect("services");
    for (name, service) in services {
        let theirs = names(service);
        if name == "idemproxy" {
            assert!(
                worker_networks.iter().all(|n| theirs.contains(n)),
                "workers reach the proxy"
            );
            assert!(
                theirs.iter().any(|n| !internal(n)),
                "the proxy reaches providers"
            );
        } else {
            assert!(
                theirs.iter().all(|n| internal(n)),
                "{name} has a route out past the proxy: {theirs:?}"
            );
        }
    }
}
