//! Which tool calls an MCP route leaves unclaimed: those it lists read-only, and — on a route
//! that trusts annotations — those the server's own `tools/list` marks `readOnlyHint`, asked
//! with the caller's headers and kept per endpoint (scheme, host, port, path: two MCP servers
//! on one host are two lists) and account (`mcp::protect`). The probe speaks the caller's
//! revision: under 2026-07-28 it carries the caller's `params._meta` envelope and
//! `MCP-Protocol-Version`, as the server requires of every request.

use bytes::Bytes;
use http::{header, HeaderValue, Request, Uri};
use serde_json::Value;

use super::content_type;
use crate::http::body::{read_limited, Body};
use crate::mcp::identity::{CallIdentity, PROTOCOL_VERSION_META};
use crate::mcp::protect::{self, Protection};
use crate::mcp::{replay, sse, McpRules};
use crate::outbound::upstream::Upstream;
use crate::proxy::outgoing::Outgoing;
use crate::proxy::App;
use crate::routes::Route;

/// The first revision whose requests carry the `_meta` envelope.
const ENVELOPE_SINCE: &str = "2026-07-28";

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
    let endpoint = endpoint(uri);
    let who = protect::listed_for(&endpoint, tenant, &call.account);
    let read_only = match rules.annotations.read_only(&who, &call.tool) {
        Some(kept) => kept,
        None => match probe(app, route, call, parts, uri).await {
            // The list just read decides this call, however briefly the server lets it be kept.
            Ok((tools, fresh_for)) => {
                rules.annotations.answered(&endpoint);
                let read_only = tools.get(&call.tool).copied().unwrap_or(false);
                rules.annotations.remember(&who, tools, fresh_for);
                read_only
            }
            Err(e) => {
                app.metrics.mcp_probe_refused(&route.name);
                let now = app.claims.clock().now_ms();
                if rules.annotations.refused(&endpoint, &e, now) {
                    tracing::warn!(route = %route.name, %endpoint, answer = %e, "the MCP server refused the proxy's tools/list (trust_annotations): every tool of this endpoint is protected, its read-only tools answered from receipts; logged once per endpoint, counted in idemproxy_mcp_annotation_probes_refused_total, shown on the console's overview");
                } else {
                    tracing::debug!(route = %route.name, %endpoint, answer = %e, "the server's tool list could not be read: the call is protected");
                }
                return Protection::Protected;
            }
        },
    };
    if read_only {
        Protection::ReadOnly("the server annotates it readOnlyHint")
    } else {
        Protection::Protected
    }
}

/// The MCP endpoint a call goes to: scheme, authority (host and port) and path, no query.
pub(super) fn endpoint(uri: &Uri) -> String {
    format!(
        "{}://{}{}",
        uri.scheme_str().unwrap_or("https"),
        uri.authority().map(|a| a.as_str()).unwrap_or(""),
        uri.path()
    )
}

/// The revision the caller speaks, when it is one whose requests carry the envelope: the
/// call's own `_meta`, else its `MCP-Protocol-Version` header.
fn enveloped_revision(call: &CallIdentity, headers: &http::HeaderMap) -> Option<String> {
    if let Some(v) = call
        .envelope
        .as_ref()
        .and_then(|e| e.get(PROTOCOL_VERSION_META))
        .and_then(Value::as_str)
    {
        return Some(v.to_string());
    }
    headers
        .get("mcp-protocol-version")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| *v >= ENVELOPE_SINCE)
        .map(String::from)
}

/// A probe page's params: the cursor, and under 2026-07-28 the caller's envelope (a
/// capabilities object is required: an empty one where the caller's is not known).
fn page_params(cursor: Option<&str>, call: &CallIdentity, revision: Option<&str>) -> Value {
    let mut params = serde_json::Map::new();
    if let Some(c) = cursor {
        params.insert("cursor".into(), Value::String(c.to_string()));
    }
    if let Some(revision) = revision {
        let mut meta = call.envelope.clone().unwrap_or_default();
        meta.insert(PROTOCOL_VERSION_META.into(), Value::String(revision.into()));
        meta.entry("io.modelcontextprotocol/clientCapabilities")
            .or_insert_with(|| Value::Object(Default::default()));
        params.insert("_meta".into(), Value::Object(meta));
    }
    Value::Object(params)
}

/// Pages through the server's `tools/list` with the caller's headers (credentials, session,
/// protocol version), reading each tool's `readOnlyHint`, and how long the list may be kept
/// (the shortest `ttlMs` of its pages).
async fn probe(
    app: &App,
    route: &Route,
    call: &CallIdentity,
    parts: &http::request::Parts,
    uri: &Uri,
) -> Result<
    (
        std::collections::BTreeMap<String, bool>,
        std::time::Duration,
    ),
    String,
> {
    let revision = enveloped_revision(call, &parts.headers);
    let mut all = std::collections::BTreeMap::new();
    let mut fresh_for = protect::FRESH_FOR;
    let mut cursor: Option<String> = None;
    for page in 0..20 {
        let params = page_params(cursor.as_deref(), call, revision.as_deref());
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
        if let Some(v) = revision
            .as_deref()
            .and_then(|r| HeaderValue::from_str(r).ok())
        {
            headers.insert("mcp-protocol-version", v);
        }
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
        let result = message.get("result").ok_or_else(|| {
            format!(
                "the server answered with an error: {}",
                message.get("error").unwrap_or(&Value::Null)
            )
        })?;
        let (tools, next) = protect::read_page(result);
        all.extend(tools);
        if let Some(ttl) = protect::page_ttl(result) {
            fresh_for = fresh_for.min(ttl);
        }
        match next {
            Some(c) => cursor = Some(c),
            None => return Ok((all, fresh_for)),
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
        let status = resp.status();
        // The server's own words say why (a missing envelope, a refused token): the
        // operator reads them in the log line.
        let said = read_limited(resp.into_body(), 2048)
            .await
            .unwrap_or_default();
        let said = String::from_utf8_lossy(&said);
        return Err(format!("the server answered {status}: {}", said.trim()));
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
