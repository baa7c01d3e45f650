//! Tool calls to a remote MCP server (Streamable HTTP), exactly once. The server is built with
//! the official Python SDK (FastMCP, `tests/python/mcp_remote_server.py`) and serves TLS with
//! a certificate for `mcp.tools.example`; its write tools count their effects in a file. The
//! proxy runs the shipped `config/examples/mcp.toml` (only `connect_to` and `upstream_ca`
//! changed), and every call is a new process of the official Python client
//! (`tests/python/mcp_call.py`: defaults, no key) with only the setup `idemproxy env` prints.
//! The cases written as functions of `Sdk` run for the other clients in `mcp_clients`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::pki::TestPki;
use crate::common::provider::{FakeProvider, ProviderOptions};
use crate::common::worker::{python_script, Worker};

pub(crate) const URL: &str = "https://mcp.tools.example/mcp";
pub(crate) const HOST: &str = "mcp.tools.example";

/// The stand-in MCP server, killed when dropped.
pub(crate) struct McpServer {
    child: Child,
    pub(crate) port: u16,
    effects: PathBuf,
    _dir: tempfile::TempDir,
}

#[derive(Clone, Copy)]
pub(crate) enum Framing {
    Json,
    Sse,
}

/// Which official Python SDK serves and calls: 1.x speaks the 2025-11-25 revision (initialize,
/// sessions); 2.x also the 2026-07-28 one (`server/discover`, no sessions, mirrored headers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sdk {
    V1,
    V2,
    /// The TypeScript SDK's client (`tests/node/mcp_call.mjs`) against the 1.x server.
    Node,
    /// The OpenAI Agents SDK's MCP adapter (over the 1.x client) against the 1.x server.
    Agents,
}

impl Sdk {
    pub(crate) fn python(self) -> String {
        match self {
            Sdk::V1 | Sdk::Node | Sdk::Agents => "python3".into(),
            // A virtual environment of its own (scripts/test.sh makes it): the suite's main one
            // pins mcp < 2 for CrewAI.
            Sdk::V2 => {
                let p = crate::common::worker::repo("target/test-venv-mcp2/bin/python3");
                assert!(
                    p.exists(),
                    "{} is missing: run scripts/test.sh, which creates it with mcp 2.x",
                    p.display()
                );
                p.display().to_string()
            }
        }
    }

    /// The program and the script that make one call.
    pub(crate) fn client(self) -> (String, String) {
        match self {
            Sdk::V1 => (self.python(), python_script("mcp_call.py")),
            Sdk::V2 => (self.python(), python_script("mcp2_call.py")),
            Sdk::Agents => (self.python(), python_script("agents_mcp_call.py")),
            Sdk::Node => (
                "node".into(),
                crate::common::worker::repo("tests/node/mcp_call.mjs")
                    .display()
                    .to_string(),
            ),
        }
    }
}

impl McpServer {
    async fn start(pki: &TestPki, framing: Framing, auth: bool) -> McpServer {
        Self::start_with(Sdk::V1, pki, framing, auth).await
    }

    pub(crate) async fn start_with(
        sdk: Sdk,
        pki: &TestPki,
        framing: Framing,
        auth: bool,
    ) -> McpServer {
        Self::start_flags(sdk, pki, framing, if auth { &["--auth"] } else { &[] }).await
    }

    pub(crate) async fn start_flags(
        sdk: Sdk,
        pki: &TestPki,
        framing: Framing,
        flags: &[&str],
    ) -> McpServer {
        Self::start_script(
            &sdk.python(),
            "mcp_remote_server.py",
            HOST,
            pki,
            framing,
            flags,
        )
        .await
    }

    /// `script` (in tests/python) run by `python`, serving TLS for `host`.
    pub(crate) async fn start_script(
        python: &str,
        script: &str,
        host: &str,
        pki: &TestPki,
        framing: Framing,
        flags: &[&str],
    ) -> McpServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let stem = dir.path().join("server");
        pki.write_leaf(&[host], &stem);
        let port = crate::common::free_port();
        let effects = dir.path().join("effects.jsonl");
        let mut cmd = Command::new(python);
        cmd.arg(python_script(script))
            .args(["--port", &port.to_string()])
            .arg("--cert")
            .arg(stem.with_extension("pem"))
            .arg("--key")
            .arg(stem.with_extension("key"))
            .arg("--effects")
            .arg(&effects)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if matches!(framing, Framing::Json) {
            cmd.arg("--json");
        }
        cmd.args(flags);
        let child = cmd
            .spawn()
            .expect("start the MCP server (python3 with mcp)");
        let server = McpServer {
            child,
            port,
            effects,
            _dir: dir,
        };
        crate::common::eventually_async(
            "the MCP server listens",
            Duration::from_secs(30),
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
        server
    }

    /// Every effect so far: `{"tool", "args"}`.
    pub(crate) fn effects(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.effects)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    pub(crate) fn count(&self, tool: &str) -> usize {
        self.effects().iter().filter(|e| e["tool"] == tool).count()
    }

    /// How many `tool` calls the server has sent its whole answer to (`--record-answers`).
    pub(crate) fn answered(&self, tool: &str) -> usize {
        let mut path = self.effects.clone().into_os_string();
        path.push(".answered");
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter(|l| serde_json::from_str::<Value>(l).is_ok_and(|e| e["tool"] == tool))
            .count()
    }

    /// Lets `late_refund` of `charge` answer.
    pub(crate) fn let_answer(&self, charge: &str) {
        let mut path = self.effects.clone().into_os_string();
        path.push(format!(".go.{charge}"));
        std::fs::write(path, b"go").expect("write the go file");
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shipped example, its MCP route dialled to `server`, its REST route to `rest`.
pub(crate) fn worker(pki: &TestPki, server: &McpServer, rest: &FakeProvider) -> Worker {
    Worker::start(
        "mcp.toml",
        &[("tools-mcp", server.port), ("payments", rest.port())],
        pki,
    )
}

pub(crate) async fn rest_provider(pki: &TestPki) -> FakeProvider {
    FakeProvider::start_https(
        ProviderOptions::default(),
        pki.server_config(&["api.payments.example"]),
    )
    .await
}

/// One tool call: a new process of the official client (1.x).
async fn call(w: &Worker, tool: &str, args: Value, token: Option<&str>) -> Value {
    call_with(Sdk::V1, w, tool, args, token).await
}

pub(crate) async fn call_with(
    sdk: Sdk,
    w: &Worker,
    tool: &str,
    args: Value,
    token: Option<&str>,
) -> Value {
    let creds: Vec<(&str, &str)> = token.map(|t| ("MCP_TOKEN", t)).into_iter().collect();
    call_at(sdk, w, URL, tool, args, &creds).await
}

/// One tool call of `sdk`'s client at `url`, with `env` (MCP_TOKEN, MCP_ELICIT_DELAY…) besides
/// the worker's setup.
pub(crate) async fn call_at(
    sdk: Sdk,
    w: &Worker,
    url: &str,
    tool: &str,
    args: Value,
    env: &[(&str, &str)],
) -> Value {
    let (program, script) = sdk.client();
    let args = args.to_string();
    w.run(&program, &[&script, url, tool, &args], env).await
}

/// The tool's result object: its text content, parsed (the SDKs put a dict result there as JSON).
pub(crate) fn result(v: &Value) -> Value {
    let text = v["text"][0]
        .as_str()
        .unwrap_or_else(|| panic!("no text content: {v}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {v}"))
}

pub(crate) fn ok(v: &Value) -> &Value {
    assert!(v.get("error").is_none(), "the call failed: {v}");
    v
}

/// The same calls on a server answering with JSON bodies and on one answering with streams.
async fn rerun_is_one_effect(sdk: Sdk, framing: Framing) {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(sdk, &pki, framing, false).await;
    let call = |w, tool, args, token| call_with(sdk, w, tool, args, token);
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);

    // A write tool re-run: one effect, the first result.
    let first = call(
        &w,
        "create_customer",
        json!({"email": "a@example.com"}),
        None,
    )
    .await;
    let rerun = call(
        &w,
        "create_customer",
        json!({"email": "a@example.com"}),
        None,
    )
    .await;
    assert_eq!(server.count("create_customer"), 1, "{first} / {rerun}");
    if matches!(sdk, Sdk::V2) {
        assert_eq!(first["protocol"], json!("2026-07-28"), "{first}");
    }
    assert_eq!(result(ok(&first)), result(ok(&rerun)));
    assert_eq!(result(&first)["customer"], json!("cus_1"));
    assert_eq!(first["text"], rerun["text"]);
    assert_eq!(
        (first["replayed"].clone(), rerun["replayed"].clone()),
        (json!(false), json!(true))
    );
    // Other arguments: another call.
    ok(&call(
        &w,
        "create_customer",
        json!({"email": "b@example.com"}),
        None,
    )
    .await);
    assert_eq!(server.count("create_customer"), 2);

    // A read-only tool (listed in the example) is never cached: the second call sees the
    // effects made since.
    let before = ok(&call(&w, "get_balance", json!({}), None).await).clone();
    ok(&call(&w, "send_email", json!({"to": "x@example.com"}), None).await);
    let after = ok(&call(&w, "get_balance", json!({}), None).await).clone();
    assert_eq!(after["replayed"], json!(false));
    let seen = |v: &Value| {
        result(v)["effects_so_far"]
            .as_i64()
            .unwrap_or_else(|| panic!("{v}"))
    };
    assert_eq!(seen(&after), seen(&before) + 1, "{before} / {after}");

    // An annotation that lies (readOnlyHint on a write): the route does not trust annotations,
    // so the tool is protected.
    let paid = call(&w, "mark_paid", json!({"invoice": "in_1"}), None).await;
    let again = call(&w, "mark_paid", json!({"invoice": "in_1"}), None).await;
    assert_eq!(server.count("mark_paid"), 1, "{paid} / {again}");
    assert_eq!(ok(&again)["replayed"], json!(true));

    // A per-tool template: the same charge with another reason is the same refund.
    let r1 = call(
        &w,
        "create_refund",
        json!({"charge": "ch_1", "amount": 500, "reason": "duplicate"}),
        None,
    )
    .await;
    let r2 = call(
        &w,
        "create_refund",
        json!({"charge": "ch_1", "amount": 500, "reason": "customer asked"}),
        None,
    )
    .await;
    assert_eq!(server.count("create_refund"), 1, "{r1} / {r2}");
    assert_eq!(result(ok(&r1)), result(ok(&r2)));

    // An isError result executed (the proxy cannot read "nothing happened" from free text):
    // kept and replayed.
    let f1 = call(&w, "failing_transfer", json!({"account": "acct_1"}), None).await;
    let f2 = call(&w, "failing_transfer", json!({"account": "acct_1"}), None).await;
    assert_eq!(
        (f1["isError"].clone(), f2["isError"].clone()),
        (json!(true), json!(true)),
        "{f1} / {f2}"
    );
    assert_eq!(f1["text"], f2["text"]);
    assert_eq!(server.count("failing_transfer"), 1);

    // The REST route of the same deployment keeps its protection.
    rest_twice(&w, &rest).await;
}

/// Two identical POSTs to the REST route through the worker's proxy: one effect.
async fn rest_twice(w: &Worker, rest: &FakeProvider) {
    let body = r#"{"invoice":"in_7","amount":100}"#;
    let post = || {
        Command::new("curl")
            .args([
                "-sS",
                "-i",
                "--max-time",
                "20",
                "-x",
                w.var("HTTPS_PROXY"),
                "--cacert",
            ])
            .arg(&w.ca.cert)
            .args(["-H", "content-type: application/json", "-d", body])
            .arg("https://api.payments.example/v1/payments")
            .output()
            .expect("curl")
    };
    let (a, b) = (post(), post());
    let (a, b) = (
        String::from_utf8_lossy(&a.stdout),
        String::from_utf8_lossy(&b.stdout),
    );
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert!(
        b.to_ascii_lowercase().contains("idempotent-replayed: true"),
        "{b}"
    );
    assert_eq!(rest.effects(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn json_answers_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::V1, Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stream_answers_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::V1, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn progress_passes_live_and_a_replay_is_the_final_result_only() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Sse, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let first = ok(&call(&w, "slow_refund", json!({"charge": "ch_9"}), None).await).clone();
    assert_eq!(first["progress"], json!([0.0, 1.0, 2.0]), "{first}");
    let rerun = ok(&call(&w, "slow_refund", json!({"charge": "ch_9"}), None).await).clone();
    assert_eq!(
        rerun["progress"],
        json!([]),
        "a replay holds no notifications: {rerun}"
    );
    assert_eq!(result(&rerun), result(&first));
    assert_eq!(server.count("slow_refund"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_that_cuts_the_connection_after_executing_never_executes_twice() {
    server_cut_never_executes_twice(Sdk::V1).await;
}

/// `crash_after` records its effect and the server process dies before answering; the same
/// server comes back and the client (a new process) re-runs the call: held, never run again.
pub(crate) async fn server_cut_never_executes_twice(sdk: Sdk) {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(sdk, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let first = call_with(sdk, &w, "crash_after", json!({"charge": "ch_3"}), None).await;
    assert!(first.get("error").is_some(), "{first}");
    assert_eq!(server.count("crash_after"), 1);
    // The same server comes back (a restart); the re-run is held, not executed again.
    let port = server.port;
    let effects = server.effects.clone();
    let mut again = Command::new(sdk.python());
    let dir = tempfile::tempdir().expect("tempdir");
    let stem = dir.path().join("server");
    pki.write_leaf(&[HOST], &stem);
    let mut revived = again
        .arg(python_script("mcp_remote_server.py"))
        .args(["--port", &port.to_string(), "--json"])
        .arg("--cert")
        .arg(stem.with_extension("pem"))
        .arg("--key")
        .arg(stem.with_extension("key"))
        .arg("--effects")
        .arg(&effects)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("restart the server");
    crate::common::eventually_async(
        "the MCP server is back",
        Duration::from_secs(30),
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    let rerun = call_with(sdk, &w, "crash_after", json!({"charge": "ch_3"}), None).await;
    let _ = revived.kill();
    let _ = revived.wait();
    assert_eq!(
        server.count("crash_after"),
        1,
        "never a second effect: {rerun}"
    );
    assert_eq!(
        rerun["error"]["data"]["slug"],
        json!("outcome-unknown"),
        "{rerun}"
    );
}

/// An unsigned JWT, as an OAuth server would mint it (the proxy reads, never verifies).
pub(crate) fn jwt(claims: Value) -> String {
    use base64::Engine as _;
    let enc = |v: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
    format!(
        "{}.{}.c2ln",
        enc(r#"{"alg":"RS256"}"#),
        enc(&claims.to_string())
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_token_then_a_fresh_one_executes_and_a_refreshed_token_is_the_same_account() {
    tokens_refused_refreshed(Sdk::V1).await;
}

/// A 401 for an expired token is not kept (the retry with a fresh one executes); a token
/// refreshed between a call and its re-run is the same account; another subject is another.
pub(crate) async fn tokens_refused_refreshed(sdk: Sdk) {
    let call = |w, tool, args, token| call_with(sdk, w, tool, args, token);
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(sdk, &pki, Framing::Json, true).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let args = json!({"to": "ops@example.com"});
    let refused = call(&w, "send_email", args.clone(), Some("expired")).await;
    assert!(refused.get("error").is_some(), "{refused}");
    assert_eq!(server.count("send_email"), 0);
    let today =
        jwt(json!({"iss": "https://auth.example", "sub": "agent-7", "iat": 1, "exp": 3601}));
    let first = ok(&call(&w, "send_email", args.clone(), Some(&today)).await).clone();
    assert_eq!(
        server.count("send_email"),
        1,
        "the 401 was not kept: the retry executed"
    );
    let tomorrow =
        jwt(json!({"iss": "https://auth.example", "sub": "agent-7", "iat": 90000, "exp": 93600}));
    let rerun = ok(&call(&w, "send_email", args.clone(), Some(&tomorrow)).await).clone();
    assert_eq!(
        server.count("send_email"),
        1,
        "a refreshed token is the same account"
    );
    assert_eq!(result(&rerun), result(&first));
    let someone_else = jwt(json!({"iss": "https://auth.example", "sub": "agent-8", "iat": 1}));
    ok(&call(&w, "send_email", args, Some(&someone_else)).await);
    assert_eq!(
        server.count("send_email"),
        2,
        "another subject is another account"
    );
}

/// A raw POST through the worker's proxy: (status, headers and body as text).
pub(crate) fn raw(w: &Worker, path: &str, headers: &[&str], body: &str) -> String {
    raw_within(w, path, headers, body, "20")
}

/// The same, given up after `max_time` seconds (curl hangs up).
fn raw_within(w: &Worker, path: &str, headers: &[&str], body: &str, max_time: &str) -> String {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "-i",
        "--max-time",
        max_time,
        "-x",
        w.var("HTTPS_PROXY"),
        "--cacert",
    ])
    .arg(&w.ca.cert)
    .args([
        "-H",
        "content-type: application/json",
        "-H",
        "accept: application/json, text/event-stream",
    ]);
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .args(["-d", body])
        .arg(format!("https://{HOST}{path}"))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub(crate) fn json_of(reply: &str) -> Value {
    // After the proxy's answer to CONNECT, the server's (or the proxy's) head, then the body.
    let body = reply.rsplit("\r\n\r\n").next().unwrap_or_default();
    let body = body
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or(body);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {reply}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_duplicate_keys_mismatched_headers_and_other_paths_are_never_unprotected() {
    let pki = TestPki::new("mcp");
    // Stateless JSON: every POST stands alone, as in the 2026-07-28 revision.
    let server = McpServer::start(&pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let session = {
        let init = raw(
            &w,
            "/mcp",
            &[],
            r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"curl","version":"1"}}}"#,
        );
        init.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("mcp-session-id")
                    .then(|| v.trim().to_string())
            })
            .unwrap_or_else(|| panic!("no session: {init}"))
    };
    let sid = format!("mcp-session-id: {session}");
    let call = r#"{"jsonrpc":"2.0","id":"a-1","method":"tools/call","params":{"name":"send_email","arguments":{"to":"raw@example.com"}}}"#;

    let batch = raw(&w, "/mcp", &[&sid], &format!("[{call}]"));
    assert_eq!(
        json_of(&batch)["error"]["data"]["slug"],
        json!("ambiguous-request"),
        "{batch}"
    );
    let twice = raw(
        &w,
        "/mcp",
        &[&sid],
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"a@x","to":"b@x"}}}"#,
    );
    assert_eq!(
        json_of(&twice)["error"]["data"]["slug"],
        json!("ambiguous-request"),
        "{twice}"
    );
    assert_eq!(
        json_of(&twice)["id"],
        json!(2),
        "the refusal answers the request's id"
    );
    let mirrored = raw(&w, "/mcp", &[&sid, "mcp-name: get_balance"], call);
    assert_eq!(
        json_of(&mirrored)["error"]["data"]["slug"],
        json!("ambiguous-request"),
        "{mirrored}"
    );
    let unreadable = raw(&w, "/mcp", &[&sid], "{\"jsonrpc\":");
    assert_eq!(
        json_of(&unreadable)["error"]["code"],
        json!(-32700),
        "{unreadable}"
    );
    assert_eq!(
        server.count("send_email"),
        0,
        "nothing refused reached the server"
    );

    // The call, then the same call under another id (a string kept a string, a number a
    // number): one effect, the re-run answered with its own id.
    let first = raw(&w, "/mcp", &[&sid], call);
    assert_eq!(json_of(&first)["id"], json!("a-1"), "{first}");
    let again = raw(
        &w,
        "/mcp",
        &[&sid],
        &call.replace(r#""id":"a-1""#, r#""id":41"#),
    );
    let again_json = json_of(&again);
    assert_eq!(again_json["id"], json!(41), "{again}");
    assert_eq!(
        again_json["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
        json!(true)
    );
    assert!(
        again
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{again}"
    );
    assert_eq!(
        json_of(&first)["result"]["content"],
        again_json["result"]["content"]
    );
    // Another path on the server's host (the legacy transport's /messages, a trailing slash):
    // still a tool call, still claimed — answered from the receipt, never run again.
    for path in ["/messages", "/mcp/"] {
        let other = raw(&w, path, &[&sid], call);
        assert_eq!(
            json_of(&other)["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
            json!(true),
            "{path}: {other}"
        );
    }
    assert_eq!(server.count("send_email"), 1);
    // A client's own idempotencyKey with other arguments: refused (the 422 analogue).
    let keyed = |to: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{{"name":"send_email","idempotencyKey":"k-1","arguments":{{"to":"{to}"}}}}}}"#
        )
    };
    ok_json(&raw(&w, "/mcp", &[&sid], &keyed("k@example.com")));
    let reused = raw(&w, "/mcp", &[&sid], &keyed("other@example.com"));
    assert_eq!(
        json_of(&reused)["error"]["data"]["slug"],
        json!("idempotency-key-reused"),
        "{reused}"
    );
    assert_eq!(server.count("send_email"), 2);
}

fn ok_json(reply: &str) {
    assert!(json_of(reply).get("result").is_some(), "{reply}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_2026_revision_json_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::V2, Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_2026_revision_stream_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::V2, Framing::Sse).await;
}

/// An elicitation inside the call: in 2025 a server request inside the call's stream, answered
/// by a POST the proxy passes unclaimed; in 2026 an `input_required` result (nothing executed,
/// released), then the same call with `inputResponses`. Either way: one effect, and the re-run
/// gets the result without asking the person again.
pub(crate) async fn elicitation_is_answered_once(sdk: Sdk) {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(sdk, &pki, Framing::Sse, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let first =
        ok(&call_with(sdk, &w, "confirm_refund", json!({"charge": "ch_5"}), None).await).clone();
    assert_eq!(first["asked"].as_array().map(Vec::len), Some(1), "{first}");
    assert!(first["text"].to_string().contains("re_1"), "{first}");
    let rerun =
        ok(&call_with(sdk, &w, "confirm_refund", json!({"charge": "ch_5"}), None).await).clone();
    assert_eq!(rerun["asked"], json!([]), "the re-run asks no one: {rerun}");
    assert_eq!(rerun["text"], first["text"]);
    assert_eq!(server.count("confirm_refund"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_elicitation_inside_the_stream_is_answered_and_the_call_runs_once() {
    elicitation_is_answered_once(Sdk::V1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_2026_revision_input_required_then_answered_runs_once() {
    elicitation_is_answered_once(Sdk::V2).await;
}

/// A 2025 session opened by hand (initialize), for raw POSTs: its `Mcp-Session-Id` header.
fn open_session(w: &Worker) -> String {
    let init = raw(
        w,
        "/mcp",
        &[],
        r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"curl","version":"1"}}}"#,
    );
    let id = init
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("mcp-session-id")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no session: {init}"));
    format!("mcp-session-id: {id}")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_hangs_up_mid_stream_does_not_abandon_the_call() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Sse, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let sid = open_session(&w);
    let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow_refund","arguments":{"charge":"ch_hang"},"_meta":{"progressToken":"p1"}}}"#;
    // The tool takes 0.6 s; the client hangs up after 0.3 s, mid-stream.
    let cut = raw_within(&w, "/mcp", &[&sid], call, "0.3");
    assert!(
        !cut.contains("re_1"),
        "the client went away before the result: {cut}"
    );
    crate::common::eventually("the tool ran", Duration::from_secs(10), || {
        (server.count("slow_refund") == 1).then_some(())
    })
    .await;
    // The proxy read the stream on and settled: the re-run (another process, another id, no
    // progress token) gets the result, and the tool ran once.
    let rerun =
        crate::common::eventually_async("the claim settled", Duration::from_secs(10), || async {
            let r = raw(&w, "/mcp", &[&sid], &call.replace(r#""id":1"#, r#""id":2"#));
            json_of(&r).get("result").is_some().then_some(r)
        })
        .await;
    let replayed = json_of(&rerun);
    assert_eq!(replayed["id"], json!(2));
    assert_eq!(
        replayed["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
        json!(true),
        "{rerun}"
    );
    assert!(replayed["result"].to_string().contains("re_1"), "{rerun}");
    assert!(
        !rerun.contains("notifications/progress"),
        "a replay holds the result only: {rerun}"
    );
    assert_eq!(server.count("slow_refund"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn trusted_annotations_leave_read_only_tools_unclaimed_and_everything_else_protected() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    // The example with trust_annotations on, and nothing listed read-only.
    let trusting = |cfg: &mut toml::Table| {
        let routes = cfg.get_mut("routes").and_then(|r| r.as_array_mut());
        for route in routes
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_table_mut())
        {
            if let Some(mcp) = route.get_mut("mcp").and_then(|m| m.as_table_mut()) {
                mcp.insert("trust_annotations".into(), true.into());
                mcp.insert("read_only".into(), toml::Value::Array(vec![]));
            }
        }
    };
    let w = Worker::start_edited(
        "mcp.toml",
        &[("tools-mcp", server.port), ("payments", rest.port())],
        &pki,
        None,
        &trusting,
    );
    // get_balance says readOnlyHint (and is): executed every time, never replayed.
    let a = ok(&call(&w, "get_balance", json!({}), None).await).clone();
    ok(&call(&w, "send_email", json!({"to": "t@example.com"}), None).await);
    let b = ok(&call(&w, "get_balance", json!({}), None).await).clone();
    assert_eq!(b["replayed"], json!(false), "{b}");
    assert_eq!(
        result(&b)["effects_so_far"].as_i64(),
        result(&a)["effects_so_far"].as_i64().map(|n| n + 1),
        "the second read saw the write"
    );
    // mark_paid says readOnlyHint and writes: a route that trusts annotations takes the
    // server at its word (the documented risk), so it runs twice.
    call(&w, "mark_paid", json!({"invoice": "in_9"}), None).await;
    call(&w, "mark_paid", json!({"invoice": "in_9"}), None).await;
    assert_eq!(server.count("mark_paid"), 2);
    // A tool without the hint stays protected.
    ok(&call(&w, "send_email", json!({"to": "t@example.com"}), None).await);
    assert_eq!(server.count("send_email"), 1);
}

/// A hint may add protection, never remove it: with `trust_annotations`, a tool the route
/// prices (here a count cap of one per run) but the server annotates `readOnlyHint` is
/// claimed and capped — a re-run replays, a second call over the cap is refused.
#[tokio::test(flavor = "multi_thread")]
async fn an_annotation_never_uncaps_a_priced_tool() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let trusting_and_capped = |cfg: &mut toml::Table| {
        let routes = cfg.get_mut("routes").and_then(|r| r.as_array_mut());
        for route in routes
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_table_mut())
            .filter(|r| r.get("protocol").and_then(|p| p.as_str()) == Some("mcp"))
        {
            if let Some(mcp) = route.get_mut("mcp").and_then(|m| m.as_table_mut()) {
                mcp.insert("trust_annotations".into(), true.into());
                mcp.insert("read_only".into(), toml::Value::Array(vec![]));
            }
            let spend: toml::Table = toml::from_str(
                "operations = [\"mark_paid\"]\ncaps_currency = \"usd\"\ncount_per_run = 1\n",
            )
            .expect("spend table");
            route.insert("spend".into(), spend.into());
        }
    };
    let w = Worker::start_edited(
        "mcp.toml",
        &[("tools-mcp", server.port), ("payments", rest.port())],
        &pki,
        None,
        &trusting_and_capped,
    );
    let first = call(&w, "mark_paid", json!({"invoice": "in_1"}), None).await;
    ok(&first);
    let rerun = call(&w, "mark_paid", json!({"invoice": "in_1"}), None).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    let over = call(&w, "mark_paid", json!({"invoice": "in_2"}), None).await;
    assert!(
        over.get("error").is_some() || over["isError"] == json!(true),
        "a second call over the count cap: {over}"
    );
    assert_eq!(server.count("mark_paid"), 1, "claimed, replayed, capped");
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_json_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::Node, Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_stream_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::Node, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_elicitation_inside_the_stream_runs_once() {
    elicitation_is_answered_once(Sdk::Node).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_json_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::Agents, Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_stream_rerun_is_one_effect_and_read_only_tools_run_every_time() {
    rerun_is_one_effect(Sdk::Agents, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_closed_early_settles_from_the_resumed_get_one_effect_nothing_held() {
    polled_call_is_settled_by_the_resumed_get(Sdk::V1).await;
}

/// SSE polling (2025-11-25): the server closes the call's stream after a progress event; the
/// client resumes it with a GET and Last-Event-ID, where the result arrives.
pub(crate) async fn polled_call_is_settled_by_the_resumed_get(sdk: Sdk) {
    let call = |w, tool, args, token| call_with(sdk, w, tool, args, token);
    let pki = TestPki::new("mcp");
    let server = McpServer::start_flags(sdk, &pki, Framing::Sse, &["--resumable"]).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    // The server closes the call's stream after a progress event; the client resumes it with a
    // GET and Last-Event-ID, where the result arrives.
    let first = ok(&call(&w, "polled_refund", json!({"charge": "ch_poll"}), None).await).clone();
    assert_eq!(result(&first)["refund"], json!("re_1"), "{first}");
    // The result on the resumed GET settled the claim: the re-run is a replay, not held.
    let rerun = call(&w, "polled_refund", json!({"charge": "ch_poll"}), None).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(result(&rerun), result(&first));
    assert_eq!(server.count("polled_refund"), 1);
}

/// The example with `edit` applied to its MCP route.
pub(crate) fn edited_worker(
    pki: &TestPki,
    server: &McpServer,
    rest: &FakeProvider,
    edit: &dyn Fn(&mut toml::Table),
) -> Worker {
    let on_mcp_route = |cfg: &mut toml::Table| {
        let routes = cfg.get_mut("routes").and_then(|r| r.as_array_mut());
        for route in routes
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_table_mut())
            .filter(|r| r.get("protocol").and_then(|p| p.as_str()) == Some("mcp"))
        {
            edit(route);
        }
    };
    Worker::start_edited(
        "mcp.toml",
        &[("tools-mcp", server.port), ("payments", rest.port())],
        pki,
        None,
        &on_mcp_route,
    )
}

pub(crate) fn set_mcp(route: &mut toml::Table, key: &str, value: toml::Value) {
    if let Some(mcp) = route.get_mut("mcp").and_then(|m| m.as_table_mut()) {
        mcp.insert(key.into(), value);
    }
}

/// A raw 2026-07-28 `tools/call` of `confirm_refund` (stateless: no session), optionally
/// carrying the answers to the question the server asked and its state.
fn confirm_call(id: u32, charge: &str, answered: Option<&str>) -> String {
    let meta = r#""_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{"elicitation":{}}}"#;
    let answers = match answered {
        Some(state) => format!(
            r#""inputResponses":{{"__main__:ask":{{"action":"accept","content":{{"ok":true}}}}}},"requestState":"{state}","#
        ),
        None => String::new(),
    };
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"confirm_refund","arguments":{{"charge":"{charge}"}},{answers}{meta}}}}}"#
    )
}

const MODERN: [&str; 3] = [
    "mcp-protocol-version: 2026-07-28",
    "mcp-method: tools/call",
    "mcp-name: confirm_refund",
];

#[tokio::test(flavor = "multi_thread")]
async fn an_input_required_call_keeps_its_claim_for_the_continuation_and_a_duplicate_waits() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(Sdk::V2, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = edited_worker(&pki, &server, &rest, &|route| {
        set_mcp(route, "answer_timeout", "4s".into())
    });
    // The first round: the server asks (nothing executed).
    let asked = json_of(&raw(&w, "/mcp", &MODERN, &confirm_call(1, "ch_mrtr", None)));
    assert_eq!(
        asked["result"]["resultType"],
        json!("input_required"),
        "{asked}"
    );
    let state = asked["result"]["requestState"]
        .as_str()
        .unwrap_or_else(|| panic!("no requestState: {asked}"))
        .to_string();
    // A duplicate between the rounds (a re-run, no answers): the call is in flight, never a
    // second first round under a claim of its own.
    let duplicate = json_of(&raw(&w, "/mcp", &MODERN, &confirm_call(2, "ch_mrtr", None)));
    assert_eq!(duplicate["error"]["code"], json!(-32009), "{duplicate}");
    assert_eq!(
        duplicate["error"]["data"]["slug"],
        json!("request-in-flight"),
        "{duplicate}"
    );
    // The continuation (another id, the answers and the state) runs under the first round's
    // claim: the refund, once.
    let done = json_of(&raw(
        &w,
        "/mcp",
        &MODERN,
        &confirm_call(3, "ch_mrtr", Some(&state)),
    ));
    assert_eq!(done["id"], json!(3), "{done}");
    assert!(done["result"].to_string().contains("re_1"), "{done}");
    assert_eq!(server.count("confirm_refund"), 1);
    // A re-run gets the kept result, without the question.
    let rerun = json_of(&raw(&w, "/mcp", &MODERN, &confirm_call(4, "ch_mrtr", None)));
    assert_eq!(
        rerun["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
        json!(true),
        "{rerun}"
    );
    assert_eq!(rerun["result"]["content"], done["result"]["content"]);
    assert_eq!(server.count("confirm_refund"), 1);

    // Nobody continues within answer_timeout: the wait lapses like a release (nothing ran),
    // and the next call asks again instead of being held.
    let asked = json_of(&raw(&w, "/mcp", &MODERN, &confirm_call(5, "ch_gone", None)));
    assert_eq!(asked["result"]["resultType"], json!("input_required"));
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let again = json_of(&raw(&w, "/mcp", &MODERN, &confirm_call(6, "ch_gone", None)));
    assert_eq!(
        again["result"]["resultType"],
        json!("input_required"),
        "{again}"
    );
    assert_eq!(server.count("confirm_refund"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_elicitation_answered_after_the_route_timeout_settles_the_call_once() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Sse, false).await;
    let rest = rest_provider(&pki).await;
    // The route gives a call 2 s; the person takes 4 s to answer.
    let w = edited_worker(&pki, &server, &rest, &|route| {
        route.insert("timeout".into(), "2s".into());
    });
    let (program, script) = Sdk::V1.client();
    let args = json!({"charge": "ch_slow"}).to_string();
    let first = w
        .run(
            &program,
            &[&script, URL, "confirm_refund", &args],
            &[("MCP_ELICIT_DELAY", "4")],
        )
        .await;
    assert_eq!(ok(&first)["asked"].as_array().map(Vec::len), Some(1));
    assert!(first["text"].to_string().contains("re_1"), "{first}");
    let rerun = call(&w, "confirm_refund", json!({"charge": "ch_slow"}), None).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(rerun["asked"], json!([]), "{rerun}");
    assert_eq!(rerun["text"], first["text"]);
    assert_eq!(server.count("confirm_refund"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_error_result_a_tool_declares_as_nothing_happened_is_not_kept() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = edited_worker(&pki, &server, &rest, &|route| {
        let mut tool = toml::Table::new();
        tool.insert(
            "release_errors".into(),
            toml::Value::Array(vec!["rate limited".into(), "try later".into()]),
        );
        if let Some(tools) = route
            .get_mut("mcp")
            .and_then(|m| m.as_table_mut())
            .and_then(|m| m.get_mut("tools"))
            .and_then(|t| t.as_table_mut())
        {
            tools.insert("limited_transfer".into(), tool.into());
        }
    });
    let args = json!({"account": "acct_rl"});
    // Refused by the bank: the client gets the error result as the server gave it…
    let refused = call(&w, "limited_transfer", args.clone(), None).await;
    assert_eq!(refused["isError"], json!(true), "{refused}");
    assert!(
        refused["text"].to_string().contains("Rate limited"),
        "{refused}"
    );
    // …and the retry executes: the transfer.
    let retried = call(&w, "limited_transfer", args.clone(), None).await;
    assert_eq!(ok(&retried)["isError"], json!(false), "{retried}");
    assert_eq!(retried["replayed"], json!(false));
    assert_eq!(result(&retried)["transfer"], json!("tr_2"));
    assert_eq!(server.count("limited_transfer"), 2);
    // The transfer's result is kept: a re-run replays it.
    let rerun = call(&w, "limited_transfer", args, None).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(server.count("limited_transfer"), 2);
    // An error result of a tool without release_errors is still kept.
    let f1 = call(&w, "failing_transfer", json!({"account": "acct_2"}), None).await;
    let f2 = call(&w, "failing_transfer", json!({"account": "acct_2"}), None).await;
    assert_eq!(f1["isError"], json!(true), "{f1}");
    assert_eq!(f2["replayed"], json!(true), "{f2}");
    assert_eq!(server.count("failing_transfer"), 1);
}

#[test]
fn check_config_names_a_bad_release_errors_or_answer_timeout_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.toml");
    let check = |mcp: &str| {
        let text = format!(
            "[[routes]]\nname = \"m\"\nupstream = \"https://mcp.example\"\nprotocol = \"mcp\"\n\n[routes.mcp]\nread_only = [\"get_balance\"]\n{mcp}\n"
        );
        std::fs::write(&path, text).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(["check-config", "--config"])
            .arg(&path)
            .output()
            .expect("run check-config");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (passed, said) = check("[routes.mcp.tools.pay]\nrelease_errors = [\"rate limited\"]");
    assert!(passed, "{said}");
    for (bad, why) in [
        (
            "[routes.mcp.tools.pay]\nrelease_errors = [\"^rate limited\"]",
            "regular expression",
        ),
        ("[routes.mcp.tools.pay]\nrelease_errors = [\" \"]", "empty"),
        (
            "[routes.mcp.tools.get_balance]\nrelease_errors = [\"busy\"]",
            "read_only",
        ),
    ] {
        let (passed, said) = check(bad);
        assert!(!passed, "{bad}");
        assert!(
            said.contains("mcp.tools.") && said.contains("release_errors"),
            "{said}"
        );
        assert!(said.contains(why), "{why}: {said}");
    }
    let (passed, said) = check("answer_timeout = \"0s\"");
    assert!(!passed && said.contains("mcp.answer_timeout"), "{said}");
}

#[tokio::test(flavor = "multi_thread")]
async fn fail_open_forwards_tool_calls_unprotected_while_redis_is_down_but_never_a_capped_one() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start(&pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let mut w = Worker::start_on(
        crate::common::Backend::Redis,
        "mcp.toml",
        &[("tools-mcp", server.port), ("payments", rest.port())],
        &pki,
        None,
        &|cfg: &mut toml::Table| {
            let routes = cfg.get_mut("routes").and_then(|r| r.as_array_mut());
            for route in routes
                .into_iter()
                .flatten()
                .filter_map(|r| r.as_table_mut())
                .filter(|r| r.get("protocol").and_then(|p| p.as_str()) == Some("mcp"))
            {
                route.insert("fail_open".into(), true.into());
                let spend: toml::Table = toml::from_str(
                    r#"
                    operations = ["create_refund"]
                    amount = ["{args.amount}"]
                    currency = "usd"
                    unit = "minor"
                    caps_currency = "usd"
                    per_request = "200.00"
                    "#,
                )
                .expect("spend table");
                route.insert("spend".into(), spend.into());
            }
        },
    );
    // With the store up: claimed, a re-run replayed.
    ok(&call(&w, "send_email", json!({"to": "up@example.com"}), None).await);
    let rerun = call(&w, "send_email", json!({"to": "up@example.com"}), None).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(server.count("send_email"), 1);
    let sid = open_session(&w);

    w.store.redis.as_mut().expect("a Redis store").kill();
    // The store is down: a tool call goes through unprotected, marked so…
    let down = raw(
        &w,
        "/mcp",
        &[&sid],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"down@example.com"}}}"#,
    );
    assert!(json_of(&down).get("result").is_some(), "{down}");
    assert!(
        down.to_ascii_lowercase()
            .contains("x-idemproxy-warning: unprotected: store unavailable"),
        "{down}"
    );
    // …and unprotected means what it says: the same call again executes again.
    ok(&call(&w, "send_email", json!({"to": "down@example.com"}), None).await);
    assert_eq!(server.count("send_email"), 3);
    // A capped tool never goes through without the store: its caps cannot be counted.
    let capped = call(
        &w,
        "create_refund",
        json!({"charge": "ch_down", "amount": 500}),
        None,
    )
    .await;
    assert!(capped.get("error").is_some(), "{capped}");
    assert_eq!(server.count("create_refund"), 0);
}
