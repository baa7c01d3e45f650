//! The final response of a tool call as it is kept, and as it answers a re-run: only that
//! response (never the notifications or server requests streamed before it, never an event
//! id), with the re-run's JSON-RPC id (a string stays a string), a marker under a namespaced
//! `_meta` key, framed as JSON or as one SSE `message` event, whichever the client accepts
//! (the first call's framing when it accepts both).

use http::HeaderMap;
use serde_json::Value;

/// The `_meta` key a replayed result carries.
pub const MARKER: &str = "io.idemproxy/replay";

pub const JSON: &str = "application/json";
pub const SSE: &str = "text/event-stream";

/// What a kept response means for its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    /// A complete result (`isError: true` included), or a task handle: it happened (the task
    /// is durably created, the tool runs); kept, so a re-run gets the same task.
    Complete,
    /// A JSON-RPC error or `input_required`: nothing executed yet, nothing to keep.
    NotKept,
}

/// Whether `message` is the response to the request `id`.
pub fn answers(message: &Value, id: &Value) -> bool {
    message.get("id") == Some(id)
        && message.get("method").is_none()
        && (message.get("result").is_some() || message.get("error").is_some())
}

/// How a final response settles its claim. A complete result does (`resultType` absent before
/// 2026-07-28), and so does a task handle (the tasks extension's `resultType: "task"` with its
/// `taskId`): a server sends one only once the task is durably created, so the call has taken
/// effect and a re-run must follow that task, not start another. Other result types
/// (`input_required`) executed nothing yet.
pub fn classify(message: &Value) -> Final {
    let Some(result) = message.get("result") else {
        return Final::NotKept;
    };
    match result.get("resultType").and_then(Value::as_str) {
        None | Some("complete") => Final::Complete,
        Some("task") if result.get("taskId").and_then(Value::as_str).is_some() => Final::Complete,
        Some(_) => Final::NotKept,
    }
}

/// Which framings the client takes (`Accept`; none means both).
pub fn accepts(headers: &HeaderMap) -> (bool, bool) {
    let mut any = false;
    let (mut json, mut sse) = (false, false);
    for v in headers.get_all(http::header::ACCEPT) {
        for item in v.to_str().unwrap_or("").split(',') {
            any = true;
            let media = item
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            json |= media == JSON || media == "*/*" || media == "application/*";
            sse |= media == SSE || media == "*/*" || media == "text/*";
        }
    }
    if !any {
        return (true, true);
    }
    (json, sse)
}

/// A kept response answering the re-run `id`: (content type, body).
pub fn replay(
    kept: &[u8],
    first_framing: &str,
    id: &Value,
    accept: (bool, bool),
) -> (String, Vec<u8>) {
    let mut message: Value = serde_json::from_slice(kept).unwrap_or(Value::Null);
    if let Some(obj) = message.as_object_mut() {
        obj.insert("id".into(), id.clone());
        if let Some(Value::Object(result)) = obj.get_mut("result") {
            let meta = result
                .entry("_meta")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(meta) = meta {
                meta.insert(MARKER.into(), serde_json::json!({"replayed": true}));
            }
        }
    }
    let text = message.to_string();
    let (json, sse) = accept;
    let as_sse = sse && (!json || first_framing == SSE);
    if as_sse {
        (
            SSE.into(),
            format!("event: message\ndata: {text}\n\n").into_bytes(),
        )
    } else {
        (JSON.into(), text.into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_replay_carries_the_rerun_id_and_a_marker() {
        let kept = json!({"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"re_1"}],"isError":false}}).to_string();
        let (ct, body) = replay(kept.as_bytes(), JSON, &json!("abc"), (true, true));
        assert_eq!(ct, JSON);
        let v: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["id"], json!("abc"));
        assert_eq!(v["result"]["_meta"][MARKER]["replayed"], json!(true));
        assert_eq!(v["result"]["content"][0]["text"], json!("re_1"));
        let (ct, body) = replay(kept.as_bytes(), SSE, &json!(3), (true, true));
        assert_eq!(ct, SSE);
        let text = String::from_utf8(body).expect("text");
        assert!(text.starts_with("event: message\ndata: {"), "{text}");
        assert!(text.ends_with("\n\n") && !text.contains("id:"), "{text}");
        let (ct, _) = replay(kept.as_bytes(), SSE, &json!(3), (true, false));
        assert_eq!(ct, JSON);
    }

    #[test]
    fn only_complete_results_are_kept() {
        assert_eq!(classify(&json!({"result":{"content":[]}})), Final::Complete);
        assert_eq!(
            classify(&json!({"result":{"isError":true,"content":[]}})),
            Final::Complete
        );
        assert_eq!(
            classify(&json!({"result":{"resultType":"complete"}})),
            Final::Complete
        );
        assert_eq!(
            classify(&json!({"result":{"resultType":"input_required"}})),
            Final::NotKept
        );
        assert_eq!(
            classify(&json!({"result":{"resultType":"task","taskId":"t1","status":"working"}})),
            Final::Complete
        );
        // No task id: no task anyone could follow.
        assert_eq!(
            classify(&json!({"result":{"resultType":"task"}})),
            Final::NotKept
        );
        assert_eq!(
            classify(&json!({"error":{"code":-32602,"message":"bad"}})),
            Final::NotKept
        );
    }

    #[test]
    fn accept_lists() {
        let h = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("accept", v.parse().expect("value"));
            h
        };
        assert_eq!(accepts(&HeaderMap::new()), (true, true));
        assert_eq!(
            accepts(&h("application/json, text/event-stream")),
            (true, true)
        );
        assert_eq!(accepts(&h("text/event-stream")), (false, true));
    }
}
