//! The cases of tests/it/mcp.rs for every MCP client as shipped: the official Python client
//! (1.x, and 2.x for the 2026-07-28 revision), the official TypeScript client
//! (`@modelcontextprotocol/sdk`, `tests/node/mcp_call.mjs`) and the OpenAI Agents SDK's MCP
//! adapter (`tests/python/agents_mcp_call.py`). Each call is a new process with only the setup
//! `idemproxy env` prints; the stand-in server is the one of tests/it/mcp.rs. What a client
//! cannot do as shipped is said in docs/mcp.md ("Tested clients"), with the file that shows it.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common::pki::TestPki;
use crate::common::worker::Worker;
use crate::mcp::{
    call_at, call_with, edited_worker, json_of, ok, raw, rest_provider, result, set_mcp, worker,
    Framing, McpServer, Sdk, HOST, URL,
};

/// A client's call as a process the test can stop and kill: the worker's setup, the call's
/// JSON on stdout.
fn spawn_call(sdk: Sdk, w: &Worker, tool: &str, args: &Value) -> tokio::process::Child {
    let (program, script) = sdk.client();
    tokio::process::Command::new(program)
        .args([script.as_str(), URL, tool, &args.to_string()])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", std::env::var("HOME").unwrap_or_default())
        .envs(w.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the client")
}

fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("the client is running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// SIGKILLs the client and checks it died of it, having printed nothing: it never read the
/// answer.
async fn killed(child: tokio::process::Child) {
    signal(&child, "-KILL");
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("the killed client is reaped")
        .expect("wait for the client");
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(out.status.signal(), Some(9), "killed: {:?}", out.status);
    assert!(
        out.stdout.is_empty(),
        "the client printed a result before it was killed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The worker killed mid-call, twice: once before the server answers (the proxy reads the
/// answer on without a client), once after the server answered the proxy but before the client
/// read it (the client stopped, the answer sent, then the client SIGKILLed). Each time a new
/// client process re-runs the call: the result, one effect.
async fn worker_killed_the_rerun_gets_the_result(sdk: Sdk, framing: Framing) {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_flags(sdk, &pki, framing, &["--record-answers"]).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let effect_made = |n: usize| {
        let server = &server;
        move || (server.count("late_refund") == n).then_some(())
    };

    // Killed before the server answered.
    let args = json!({"charge": "ch_k1"});
    let client = spawn_call(sdk, &w, "late_refund", &args);
    crate::common::eventually("the refund ran", Duration::from_secs(30), effect_made(1)).await;
    killed(client).await;
    assert_eq!(
        server.answered("late_refund"),
        0,
        "killed before the answer"
    );
    server.let_answer("ch_k1");
    crate::common::eventually("the server answered", Duration::from_secs(10), || {
        (server.answered("late_refund") == 1).then_some(())
    })
    .await;
    let rerun = rerun_once_settled(sdk, &w, &args).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(result(&rerun)["refund"], json!("re_1"), "{rerun}");

    // Killed after the server answered the proxy, before the client read the answer.
    let args = json!({"charge": "ch_k2"});
    let client = spawn_call(sdk, &w, "late_refund", &args);
    crate::common::eventually("the refund ran", Duration::from_secs(30), effect_made(2)).await;
    signal(&client, "-STOP");
    server.let_answer("ch_k2");
    crate::common::eventually("the server answered", Duration::from_secs(10), || {
        (server.answered("late_refund") == 2).then_some(())
    })
    .await;
    killed(client).await;
    let rerun = rerun_once_settled(sdk, &w, &args).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(result(&rerun)["refund"], json!("re_2"), "{rerun}");
    assert_eq!(server.count("late_refund"), 2, "one effect per call");
}

/// The re-run, a new client process. The server's answer is in, but the proxy settles the
/// claim in the call's own task: a re-run racing that settle is told the call is in flight
/// (`-32009`) and runs again a moment later, as an agent's retry would.
async fn rerun_once_settled(sdk: Sdk, w: &Worker, args: &Value) -> Value {
    for _ in 0..10 {
        let rerun = call_with(sdk, w, "late_refund", args.clone(), None).await;
        if !rerun.to_string().contains("request-in-flight") {
            return rerun;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!("the killed worker's call never settled")
}

/// A client pointed at another path of the server: the same tool call, claimed the same,
/// whichever path made it first. `/mcp/` is redirected to `/mcp` by the server (Starlette's
/// trailing-slash redirect, which the clients follow); `/messages` is served as it is.
async fn alternate_paths_are_one_call(sdk: Sdk) {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_flags(sdk, &pki, Framing::Json, &["--alias", "/messages"]).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let args = json!({"to": "paths@example.com"});
    let first = call_at(
        sdk,
        &w,
        &format!("https://{HOST}/mcp/"),
        "send_email",
        args.clone(),
        &[],
    )
    .await;
    assert_eq!(ok(&first)["replayed"], json!(false), "{first}");
    for url in [URL.to_string(), format!("https://{HOST}/messages")] {
        let rerun = call_at(sdk, &w, &url, "send_email", args.clone(), &[]).await;
        assert_eq!(ok(&rerun)["replayed"], json!(true), "{url}: {rerun}");
        assert_eq!(result(&rerun), result(&first));
    }
    assert_eq!(server.count("send_email"), 1);
}

// The official Python client 1.x (2025-11-25).

#[tokio::test(flavor = "multi_thread")]
async fn python_client_worker_killed_json_the_rerun_gets_the_result() {
    worker_killed_the_rerun_gets_the_result(Sdk::V1, Framing::Json).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python_client_worker_killed_stream_the_rerun_gets_the_result() {
    worker_killed_the_rerun_gets_the_result(Sdk::V1, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python_client_alternate_paths_are_one_call() {
    alternate_paths_are_one_call(Sdk::V1).await;
}

// The official Python client 2.x (2026-07-28: no sessions, input_required).

#[tokio::test(flavor = "multi_thread")]
async fn python2_client_worker_killed_the_rerun_gets_the_result() {
    worker_killed_the_rerun_gets_the_result(Sdk::V2, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python2_client_alternate_paths_are_one_call() {
    alternate_paths_are_one_call(Sdk::V2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python2_client_server_cut_never_executes_twice() {
    crate::mcp::server_cut_never_executes_twice(Sdk::V2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn python2_client_refused_then_fresh_token_and_refreshed_token() {
    crate::mcp::tokens_refused_refreshed(Sdk::V2).await;
}

// The official TypeScript client (@modelcontextprotocol/sdk 1.x: 2025-11-25).

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_worker_killed_stream_the_rerun_gets_the_result() {
    worker_killed_the_rerun_gets_the_result(Sdk::Node, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_alternate_paths_are_one_call() {
    alternate_paths_are_one_call(Sdk::Node).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_server_cut_never_executes_twice() {
    crate::mcp::server_cut_never_executes_twice(Sdk::Node).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_refused_then_fresh_token_and_refreshed_token() {
    crate::mcp::tokens_refused_refreshed(Sdk::Node).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn typescript_client_stream_closed_early_settles_from_the_resumed_get() {
    crate::mcp::polled_call_is_settled_by_the_resumed_get(Sdk::Node).await;
}

// The OpenAI Agents SDK's MCP adapter (over the Python client 1.x).

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_worker_killed_stream_the_rerun_gets_the_result() {
    worker_killed_the_rerun_gets_the_result(Sdk::Agents, Framing::Sse).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_alternate_paths_are_one_call() {
    alternate_paths_are_one_call(Sdk::Agents).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_server_cut_never_executes_twice() {
    crate::mcp::server_cut_never_executes_twice(Sdk::Agents).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_refused_then_fresh_token_and_refreshed_token() {
    crate::mcp::tokens_refused_refreshed(Sdk::Agents).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_stream_closed_early_settles_from_the_resumed_get() {
    crate::mcp::polled_call_is_settled_by_the_resumed_get(Sdk::Agents).await;
}

// requestState (2026-07-28 multi-round-trip) is the server's, never the call's identity.

#[tokio::test(flavor = "multi_thread")]
async fn python2_client_two_rounds_of_input_required_run_once() {
    // confirm_twice asks its second question only once the first is answered: the client
    // sends the call three times, each continuation with the requestState of the round before.
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(Sdk::V2, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = worker(&pki, &server, &rest);
    let args = json!({"charge": "ch_twice"});
    let first = ok(&call_with(Sdk::V2, &w, "confirm_twice", args.clone(), None).await).clone();
    assert_eq!(first["protocol"], json!("2026-07-28"), "{first}");
    assert_eq!(first["asked"].as_array().map(Vec::len), Some(2), "{first}");
    assert_eq!(result(&first)["refund"], json!("re_1"), "{first}");
    let rerun = ok(&call_with(Sdk::V2, &w, "confirm_twice", args, None).await).clone();
    assert_eq!(rerun["replayed"], json!(true), "{rerun}");
    assert_eq!(rerun["asked"], json!([]), "the re-run asks no one: {rerun}");
    assert_eq!(rerun["text"], first["text"]);
    assert_eq!(server.count("confirm_twice"), 1);
}

/// A raw 2026-07-28 `tools/call` of `confirm_twice`, answering (accepting) every question of
/// `asked` (the last round's result) and carrying `state` as its requestState.
fn twice_call(id: u32, asked: Option<&Value>, state: Option<&str>) -> String {
    let mut params = json!({
        "name": "confirm_twice",
        "arguments": {"charge": "ch_state"},
        "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}
        }
    });
    if let Some(asked) = asked {
        let questions = asked["result"]["inputRequests"]
            .as_object()
            .unwrap_or_else(|| panic!("no inputRequests: {asked}"));
        let answers: serde_json::Map<String, Value> = questions
            .keys()
            .map(|k| {
                (
                    k.clone(),
                    json!({"action": "accept", "content": {"ok": true}}),
                )
            })
            .collect();
        params["inputResponses"] = Value::Object(answers);
    }
    if let Some(state) = state {
        params["requestState"] = json!(state);
    }
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}).to_string()
}

const TWICE: [&str; 3] = [
    "mcp-protocol-version: 2026-07-28",
    "mcp-method: tools/call",
    "mcp-name: confirm_twice",
];

fn state_of(asked: &Value) -> String {
    assert_eq!(
        asked["result"]["resultType"],
        json!("input_required"),
        "{asked}"
    );
    asked["result"]["requestState"]
        .as_str()
        .unwrap_or_else(|| panic!("no requestState: {asked}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_continuation_with_another_request_state_is_the_same_call() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(Sdk::V2, &pki, Framing::Json, false).await;
    let rest = rest_provider(&pki).await;
    let w = edited_worker(&pki, &server, &rest, &|route| {
        set_mcp(route, "answer_timeout", "30s".into())
    });
    let send = |body: &str| json_of(&raw(&w, "/mcp", &TWICE, body));

    // A requestState the server never gave (forged, or stale from another server): the proxy
    // does not judge it. The continuation takes the waiting claim over (never -32009) and the
    // server, which seals its state, refuses it: a JSON-RPC error, released, nothing ran.
    let first = send(&twice_call(1, None, None));
    state_of(&first);
    let forged = send(&twice_call(2, Some(&first), Some("not-the-servers-state")));
    assert!(forged.get("error").is_some(), "{forged}");
    assert_ne!(forged["error"]["code"], json!(-32009), "{forged}");
    assert!(
        forged["error"]["data"].get("slug").is_none(),
        "the server's error, not the proxy's: {forged}"
    );
    assert_eq!(server.count("confirm_twice"), 0);

    // Round one again, then two continuations whose requestStates differ from each other: one
    // call all along, the second round keeping the claim for the third.
    let asked = send(&twice_call(3, None, None));
    let s1 = state_of(&asked);
    let again = send(&twice_call(4, Some(&asked), Some(&s1)));
    let s2 = state_of(&again);
    assert_ne!(s1, s2, "each round its own requestState");
    let duplicate = send(&twice_call(5, None, None));
    assert_eq!(
        duplicate["error"]["data"]["slug"],
        json!("request-in-flight"),
        "between the rounds, a re-run waits: {duplicate}"
    );
    let done = send(&twice_call(6, Some(&again), Some(&s2)));
    assert_eq!(done["id"], json!(6), "{done}");
    assert!(done["result"].to_string().contains("re_1"), "{done}");
    assert_eq!(server.count("confirm_twice"), 1);
    // A re-run with a stale requestState (round one's) is a continuation of a settled call:
    // the kept result, never a second refund.
    for (id, state) in [(7, None), (8, Some(s1.as_str()))] {
        let rerun = send(&twice_call(id, state.map(|_| &asked), state));
        assert_eq!(
            rerun["result"]["_meta"]["io.idemproxy/replay"]["replayed"],
            json!(true),
            "{rerun}"
        );
        assert_eq!(rerun["result"]["content"], done["result"]["content"]);
    }
    assert_eq!(server.count("confirm_twice"), 1);
}

/// The Agents adapter passes no elicitation callback to the MCP client, whose default answers
/// the server's elicitation with an error ("Elicitation not supported"): the tool fails
/// without its effect. Its `isError` result is kept like any other, unless the route's
/// `release_errors` names that text: then a client that can answer runs the call, once.
#[tokio::test(flavor = "multi_thread")]
async fn openai_agents_adapter_cannot_answer_an_elicitation_and_nothing_runs() {
    let pki = TestPki::new("mcp");
    let server = McpServer::start_with(Sdk::V1, &pki, Framing::Sse, false).await;
    let rest = rest_provider(&pki).await;
    let w = edited_worker(&pki, &server, &rest, &|route| {
        let tool: toml::Table = toml::from_str(r#"release_errors = ["elicitation not supported"]"#)
            .expect("tool table");
        if let Some(tools) = route
            .get_mut("mcp")
            .and_then(|m| m.as_table_mut())
            .and_then(|m| m.get_mut("tools"))
            .and_then(|t| t.as_table_mut())
        {
            tools.insert("confirm_refund".into(), tool.into());
        }
    });
    let args = json!({"charge": "ch_agents"});
    let refused = call_with(Sdk::Agents, &w, "confirm_refund", args.clone(), None).await;
    assert_eq!(refused["isError"], json!(true), "{refused}");
    assert!(
        refused["text"]
            .to_string()
            .contains("Elicitation not supported"),
        "{refused}"
    );
    assert_eq!(server.count("confirm_refund"), 0);
    let answered = ok(&call_with(Sdk::V1, &w, "confirm_refund", args.clone(), None).await).clone();
    assert_eq!(
        answered["asked"].as_array().map(Vec::len),
        Some(1),
        "{answered}"
    );
    assert_eq!(answered["replayed"], json!(false), "{answered}");
    let rerun = call_with(Sdk::V1, &w, "confirm_refund", args, None).await;
    assert_eq!(ok(&rerun)["replayed"], json!(true), "{rerun}");
    assert_eq!(server.count("confirm_refund"), 1);
}
