//! What an MCP route checks as a gateway in front of a server built with the official Python
//! SDK (`tests/python/mcp_remote_server.py`), tried the way an attacker would: a tools/call
//! with a null id, a foreign Host or Origin (DNS rebinding), another MCP endpoint on the same
//! host deciding which tools are read-only, and number spellings splitting one call. Each
//! asserts on the server's effect count and the bytes the client got.

use std::process::Command;

use serde_json::{json, Value};

use crate::common::pki::TestPki;
use crate::common::worker::Worker;
use crate::common::Backend;
use crate::mcp::{
    call_at, json_of, ok, raw, rest_provider, result, set_mcp, Framing, McpServer, Sdk, HOST,
};

const STORES: [Backend; 3] = [Backend::Sqlite, Backend::Redis, Backend::Postgres];

/// The shipped example on `backend`, `edit` applied to its MCP route.
fn worker_on(
    backend: Backend,
    pki: &TestPki,
    server: &McpServer,
    rest: u16,
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
    Worker::start_on(
        backend,
        "mcp.toml",
        &[("tools-mcp", server.port), ("payments", rest)],
        pki,
        None,
        &on_mcp_route,
    )
}

/// A 2025 session opened by hand through the proxy: its `Mcp-Session-Id` header.
fn session(w: &Worker) -> String {
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
async fn a_tool_call_with_a_null_or_no_id_is_refused_as_an_invalid_request() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(Sdk::V1, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker_on(Backend::Sqlite, &pki, &server, rest.port(), &|_| {});
    let sid = session(&w);
    for body in [
        r#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"null@example.com"}}}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"send_email","arguments":{"to":"null@example.com"}}}"#,
    ] {
        let reply = raw(&w, "/mcp", &[&sid], body);
        let answer = json_of(&reply);
        assert_eq!(answer["error"]["code"], json!(-32600), "{reply}");
        assert_eq!(answer["id"], Value::Null, "{reply}");
    }
    assert_eq!(server.count("send_email"), 0, "nothing reached the server");
    // The same call with an id is a call like any other: claimed, executed once.
    let call = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"null@example.com"}}}"#;
    for _ in 0..2 {
        let reply = raw(&w, "/mcp", &[&sid], call);
        assert!(json_of(&reply).get("result").is_some(), "{reply}");
    }
    assert_eq!(server.count("send_email"), 1);
}

/// A raw POST straight to the proxy's listener (base URL), with these headers.
fn direct(w: &Worker, path: &str, headers: &[&str], body: &str) -> (u16, String) {
    let listener = w.var("HTTPS_PROXY").trim_end_matches('/').to_string();
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "20", "-w", "\n%{http_code}"])
        .args(["-H", "content-type: application/json"])
        .args(["-H", "accept: application/json, text/event-stream"]);
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .args(["-d", body])
        .arg(format!("{listener}{path}"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or((&text, "0"));
    (status.trim().parse().unwrap_or(0), body.to_string())
}

const INITIALIZE: &str = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"rebinding","version":"1"}}}"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_foreign_host_or_origin_is_refused_with_403_before_anything_is_forwarded() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(Sdk::V1, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    // The MCP route also under a base URL on the proxy's loopback listener.
    let w = worker_on(Backend::Sqlite, &pki, &server, rest.port(), &|route| {
        route.insert("prefix".into(), "/tools".into());
    });
    let listener = w
        .var("HTTPS_PROXY")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    // A page at evil.example.com whose name rebinds to 127.0.0.1.
    let (status, said) = direct(
        &w,
        "/tools/mcp",
        &["host: evil.example.com", "origin: http://evil.example.com"],
        INITIALIZE,
    );
    assert_eq!(status, 403, "{said}");
    assert!(said.contains("foreign-origin"), "{said}");
    // The proxy's own loopback name passes.
    let (status, said) = direct(
        &w,
        "/tools/mcp",
        &[
            &format!("host: {listener}"),
            &format!("origin: http://{listener}"),
        ],
        INITIALIZE,
    );
    assert_eq!(status, 200, "{said}");
    let (status, said) = direct(
        &w,
        "/tools/mcp",
        &["origin: https://evil.example.com"],
        INITIALIZE,
    );
    assert_eq!(status, 403, "a loopback Host with a foreign Origin: {said}");
    // Through HTTPS_PROXY (the server's own name): a foreign Origin is refused, a tool call
    // with it never reaches the server.
    let sid = session(&w);
    let call = r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"send_email","arguments":{"to":"o@example.com"}}}"#;
    let refused = raw(
        &w,
        "/mcp",
        &[&sid, "origin: https://evil.example.com"],
        call,
    );
    assert!(refused.contains(" 403 "), "{refused}");
    assert_eq!(server.count("send_email"), 0);
    let own = raw(
        &w,
        "/mcp",
        &[&sid, &format!("origin: https://{HOST}")],
        call,
    );
    assert!(json_of(&own).get("result").is_some(), "{own}");
    assert_eq!(server.count("send_email"), 1);
    // A configured name passes.
    let named = worker_on(Backend::Sqlite, &pki, &server, rest.port(), &|route| {
        route.insert("prefix".into(), "/tools".into());
        set_mcp(
            route,
            "allowed_hosts",
            toml::Value::Array(vec!["agents.internal".into()]),
        );
    });
    let (status, said) = direct(&named, "/tools/mcp", &["host: agents.internal"], INITIALIZE);
    assert_eq!(status, 200, "{said}");
}

#[test]
fn check_config_names_a_bad_allowed_host_or_origin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.toml");
    let check = |mcp: &str| {
        let text = format!(
            "[[routes]]\nname = \"m\"\nupstream = \"https://mcp.example\"\nprotocol = \"mcp\"\n\n[routes.mcp]\n{mcp}\n"
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
    let (passed, said) = check(
        "allowed_hosts = [\"agents.internal\", \"localhost:9000\"]\nallowed_origins = [\"https://app.example\"]",
    );
    assert!(passed, "{said}");
    for (bad, field) in [
        (
            "allowed_hosts = [\"https://agents.internal\"]",
            "mcp.allowed_hosts",
        ),
        ("allowed_hosts = [\"*.internal\"]", "mcp.allowed_hosts"),
        ("allowed_origins = [\"app.example\"]", "mcp.allowed_origins"),
        (
            "allowed_origins = [\"https://app.example/x\"]",
            "mcp.allowed_origins",
        ),
    ] {
        let (passed, said) = check(bad);
        assert!(!passed, "{bad}");
        assert!(said.contains(field), "{field}: {said}");
    }
}

/// The example with trust_annotations on and nothing listed read-only.
fn trusting(route: &mut toml::Table) {
    set_mcp(route, "trust_annotations", true.into());
    set_mcp(route, "read_only", toml::Value::Array(vec![]));
}

#[tokio::test(flavor = "multi_thread")]
async fn another_mcp_endpoint_on_the_same_host_never_decides_which_tools_are_read_only() {
    let pki = TestPki::new("mcp");
    // /catalog is a second server on the same host: its tools/list marks every tool read-only.
    let server = McpServer::start_flags(
        Sdk::V1,
        &pki,
        Framing::Json,
        &["--read-only-alias", "/catalog"],
    )
    .await;
    let rest = rest_provider(&pki).await;
    for (n, backend) in STORES.into_iter().enumerate() {
        let w = worker_on(backend, &pki, &server, rest.port(), &trusting);
        // A call on /catalog: the proxy reads /catalog's list (everything read-only there).
        let catalog = format!("https://{HOST}/catalog");
        ok(&call_at(Sdk::V1, &w, &catalog, "get_balance", json!({}), &[]).await);
        // The same account's write tool on /mcp, twice: /mcp's own list says it writes.
        let url = format!("https://{HOST}/mcp");
        let to = json!({"to": format!("endpoint-{n}@example.com")});
        let first = ok(&call_at(Sdk::V1, &w, &url, "send_email", to.clone(), &[]).await).clone();
        let again = ok(&call_at(Sdk::V1, &w, &url, "send_email", to.clone(), &[]).await).clone();
        assert_eq!(again["replayed"], json!(true), "{backend:?}: {again}");
        assert_eq!(result(&again), result(&first));
        let sent = server
            .effects()
            .iter()
            .filter(|e| e["tool"] == "send_email" && e["args"] == to)
            .count();
        assert_eq!(sent, 1, "{backend:?}: one e-mail, not one per re-run");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_2026_server_s_read_only_tool_is_never_answered_from_a_receipt_with_trusted_annotations()
{
    let pki = TestPki::new("mcp");
    // mcp 2.x over JSON: the 2026-07-28 revision refuses a tools/list without the envelope.
    let server = McpServer::start_with(Sdk::V2, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    for (n, backend) in STORES.into_iter().enumerate() {
        let w = worker_on(backend, &pki, &server, rest.port(), &trusting);
        let url = format!("https://{HOST}/mcp");
        let call = |tool: &'static str, args: Value| {
            let w = &w;
            let url = url.clone();
            async move { ok(&call_at(Sdk::V2, w, &url, tool, args, &[]).await).clone() }
        };
        let before = call("get_balance", json!({})).await;
        let to = json!({"to": format!("balance-{n}@example.com")});
        call("send_email", to.clone()).await;
        call("send_email", to.clone()).await;
        let after = call("get_balance", json!({})).await;
        assert_eq!(after["replayed"], json!(false), "{backend:?}: {after}");
        assert_eq!(
            result(&after)["effects_so_far"].as_i64(),
            result(&before)["effects_so_far"].as_i64().map(|k| k + 1),
            "{backend:?}: the read after the payment sees it"
        );
        let sent = server
            .effects()
            .iter()
            .filter(|e| e["tool"] == "send_email" && e["args"] == to)
            .count();
        assert_eq!(sent, 1, "{backend:?}: the write tool re-run executed once");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_annotation_probe_is_counted_and_every_tool_stays_protected() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_flags(Sdk::V1, &pki, Framing::Json, &["--refuse-probe"]).await;
    let rest = rest_provider(&pki).await;
    let w = worker_on(Backend::Sqlite, &pki, &server, rest.port(), &trusting);
    let url = format!("https://{HOST}/mcp");
    let to = json!({"to": "refused@example.com"});
    for _ in 0..2 {
        ok(&call_at(Sdk::V1, &w, &url, "send_email", to.clone(), &[]).await);
    }
    assert_eq!(server.count("send_email"), 1, "protected: one effect");
    let refused = w
        .metric("idemproxy_mcp_annotation_probes_refused_total{route=\"tools-mcp\"}")
        .await;
    assert!(refused >= 1.0, "the refused probe is counted: {refused}");

    // The console's overview says which endpoint refused, when, and what the server answered,
    // its credential masked.
    let mut operator = crate::console::Operator::new(w.proxy.admin.expect("admin listener"));
    let login = operator
        .post("/console/login", &[("token", "worker-test-admin-token")])
        .await;
    operator.cookie = login
        .header("set-cookie")
        .and_then(|c| c.split(';').next().map(String::from));
    let page = operator.get("/console/overview").await;
    assert_eq!(page.status, 200, "{}", page.text());
    let html = page.text();
    let section = html
        .split("MCP servers refusing the annotation probe")
        .nth(1)
        .unwrap_or_else(|| panic!("no refused probe on the overview: {html}"));
    for part in [
        "tools-mcp",
        HOST,
        "/mcp",
        "UTC",
        "400",
        "tools/list is refused here",
    ] {
        assert!(section.contains(part), "{part}: {section}");
    }
    assert!(
        !html.contains("sk_live_probe0secret0value0123"),
        "the server's answer is redacted: {section}"
    );
}

/// Under the 2026-07-28 tasks extension a server may answer a plain `tools/call` with a task
/// handle: the task is durably created, the tool is running. That handle is the call's
/// receipt: a re-run (another JSON-RPC id, a new process) gets the same task id, and the server
/// starts one task, on every store. The task's own requests (`tasks/get`) pass through.
#[tokio::test(flavor = "multi_thread")]
async fn a_task_handle_answering_a_call_is_its_receipt_and_a_rerun_gets_the_same_task() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_flags(Sdk::V2, &pki, Framing::Json, &["--task-handles"]).await;
    let rest = rest_provider(&pki).await;
    let envelope = r#""_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{"extensions":{"io.modelcontextprotocol/tasks":{}}},"io.modelcontextprotocol/clientInfo":{"name":"curl","version":"1"}}"#;
    let headers = [
        "mcp-protocol-version: 2026-07-28",
        "mcp-method: tools/call",
        "mcp-name: start_export",
    ];
    for (n, backend) in STORES.into_iter().enumerate() {
        let w = worker_on(backend, &pki, &server, rest.port(), &|_| {});
        let call = |id: u32| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"start_export","arguments":{{"month":"2026-{n:02}"}},{envelope}}}}}"#
            )
        };
        let first = json_of(&raw(&w, "/mcp", &headers, &call(1)));
        let again = json_of(&raw(&w, "/mcp", &headers, &call(7)));
        assert_eq!(
            first["result"]["resultType"],
            json!("task"),
            "{backend:?}: {first}"
        );
        let task = first["result"]["taskId"].as_str().unwrap_or_default();
        assert!(!task.is_empty(), "{backend:?}: {first}");
        assert_eq!(again["id"], json!(7), "{backend:?}: {again}");
        assert_eq!(
            again["result"]["taskId"],
            json!(task),
            "{backend:?}: the same task: {again}"
        );
        assert_eq!(
            again["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
            json!(true),
            "{backend:?}: {again}"
        );
        let started = server
            .effects()
            .iter()
            .filter(|e| {
                e["tool"] == "start_export" && e["args"]["month"] == json!(format!("2026-{n:02}"))
            })
            .count();
        assert_eq!(
            started, 1,
            "{backend:?}: one task started, not one per re-run"
        );
        // The client follows its task with the server, through the proxy.
        let get = format!(
            r#"{{"jsonrpc":"2.0","id":9,"method":"tasks/get","params":{{"taskId":"{task}",{envelope}}}}}"#
        );
        let name = format!("mcp-name: {task}");
        let polled = json_of(&raw(
            &w,
            "/mcp",
            &[
                "mcp-protocol-version: 2026-07-28",
                "mcp-method: tasks/get",
                &name,
            ],
            &get,
        ));
        assert_eq!(
            polled["result"]["taskId"],
            json!(task),
            "{backend:?}: {polled}"
        );
    }
}

/// With `trust_annotations`, a server that says `notifications/tools/list_changed` in a call's
/// stream makes the proxy forget that endpoint's annotations: a tool it annotated read-only,
/// then (after the change) as writing, is claimed from then on — a re-run of it one effect —
/// rather than passed unclaimed for the rest of the old list's 5 minutes.
#[tokio::test(flavor = "multi_thread")]
async fn a_list_changed_notification_forgets_the_endpoints_annotations() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_flags(Sdk::V1, &pki, Framing::Json, &["--list-changes"]).await;
    let rest = rest_provider(&pki).await;
    let w = worker_on(Backend::Sqlite, &pki, &server, rest.port(), &trusting);
    let call = |id: u32, tool: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{{"n":1}}}}}}"#
        )
    };
    // Read-only as listed: runs every time.
    for id in 1..3 {
        let answer = json_of(&raw(&w, "/mcp", &[], &call(id, "toggle_tool")));
        assert!(answer.get("result").is_some(), "{answer}");
    }
    assert_eq!(server.count("toggle_tool"), 2);
    let flipped = raw(&w, "/mcp", &[], &call(3, "flip"));
    assert!(flipped.contains("flipped"), "{flipped}");
    // Its list changed: toggle_tool now writes, so it is claimed and its re-run replayed.
    for id in 4..6 {
        let answer = json_of(&raw(&w, "/mcp", &[], &call(id, "toggle_tool")));
        assert!(answer.get("result").is_some(), "{answer}");
    }
    assert_eq!(
        server.count("toggle_tool"),
        3,
        "after list_changed the re-run is one effect: {:?}",
        server.effects()
    );
}
