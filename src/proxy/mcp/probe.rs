//! Which tool calls an MCP route leaves unclaimed: those it lists read-only, and — on a route
//! that trusts annotations — those the server's own `tools/list` marks `readOnlyHint`, asked
//! with the caller's headers and kept per server and account (`mcp::protect`).

use bytes::Bytes;
use http::{header, HeaderValue, Request, Uri};
use serde_json::Value;

use super::content_type;
use crate::http::body::{read_limited, Body};
use crate::mcp::identity::CallIdentity;
use crate::mcp::protect::{self, Protection};
use crate::mcp::{replay, sse, McpRules};
use crate::outbound::upstream::Upstream;
use crate::proxy::outgoing::Outgoing;
use crate::proxy::App;
use crate::routes::Route;

/// Whether the call is claimed: see `mcp::protect`. The annotations come from the server's
/// own `tools/list`, asked with the caller's credentials, only on a route that trusts them.
pub(super) async fn protection(
    app: &App,
    route: &Route,
    rules: &McpRules,
    call: &CallIdentity,
    parts: &http::request::Parts,
    uri: &Uri,
    tenant: &str,
) -> Protection {
    if rules.read_only.contains(&call.tool) {
        return Protection::ReadOnly("listed in read_only");
    }
    if !rules.trust_annotations {
        return Protection::Protected;
    }
    let who = format!("{}|{tenant}|{}", route.upstream.authority, call.account);
    if !rules.annotations.has(&who) {
        match probe(app, route, parts, uri).await {
            Ok(tools) => rules.annotations.remember(&who, tools),
            Err(e) => {
                tracing::info!(route = %route.name, error = %e, "the server's tool list could not be read: the call is protected");
                return Protection::Protected;
            }
        }
    }
    match rules.annotations.read_only(&who, &call.tool) {
        Some(true) => Protection::ReadOnly("the server annotates it readOnlyHint"),
        _ => Protection::Protected,
    }
}

/// Pages through the server's `tools/list` with the caller's headers (credentials, session,
/// protocol version), reading each tool's `readOnlyHint`.
async fn probe(
    app: &App,
    route: &Route,
    parts: &http::request::Parts,
    uri: &Uri,
) -> Result<std::collections::BTreeMap<String, bool>, String> {
    let mut all = std::collections::BTreeMap::new();
    let mut cursor: Option<String> = None;
    for page in 0..20 {
        let mut params = serde_json::Map::new();
        if let Some(c) = &cursor {
            params.insert("cursor".into(), Value::String(c.clone()));
        }
        let body = serde_json::json!({"jsonrpc": "2.0", "id": format!("idemproxy-probe-{page}"),
            "method": "tools/list", "params": params});
        let mut headers = parts.headers.clone();
        // The call's mirrored headers would not match a tools/list.
        let mirrored: Vec<_> = headers
            .keys()
            .filter(|k| k.as_str() == "mcp-name" || k.as_str().starts_with("mcp-param-"))
            .cloned()
            .collect();
        for name in mirrored {
            headers.remove(name);
        }
        headers.insert("mcp-method", HeaderValue::from_static("tools/list"));
        headers.remove(header::CONTENT_LENGTH);
        let mut probe_parts = Request::new(()).into_parts().0;
        probe_parts.method = http::Method::POST;
        probe_parts.headers = headers;
        let outgoing = Outgoing::prepare(
            route,
            &probe_parts,
            uri.clone(),
            Bytes::from(body.to_string()),
            "",
            None,
        )
        .map_err(|e| e.to_string())?;
        let message = tokio::time::timeout(
            route.timeout,
            final_message(
                route.client.as_ref(),
                outgoing.request(None),
                &body["id"],
                app.max_receipt_bytes,
            ),
        )
        .await
        .map_err(|_| "timed out".to_string())??;
        let result = message
            .get("result")
            .ok_or("the server answered with an error")?;
        let (tools, next) = protect::read_page(result);
        all.extend(tools);
        match next {
            Some(c) => cursor = Some(c),
            None => return Ok(all),
        }
    }
    Err("more than 20 pages".into())
}

/// One request's final JSON-RPC message, from a JSON body or an event stream.
async fn final_message(
    client: &dyn Upstream,
    req: Request<Body>,
    id: &Value,
    max: usize,
) -> Result<Value, String> {
    let resp = client.send(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("the server answered {}", resp.status()));
    }
    let is_sse = content_type(resp.headers()) == replay::SSE;
    let body = read_limited(resp.into_body(), max)
        .await
        .map_err(|e| e.to_string())?;
    if is_sse {
        let mut reader = sse::Reader::default();
        let mut events = reader.feed(&body);
        events.extend(reader.feed(b"\n\n"));
        events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
            .find(|m| replay::answers(m, id))
            .ok_or_else(|| "the stream held no answer".to_string())
    } else {
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    }
}
