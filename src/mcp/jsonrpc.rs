//! One JSON-RPC message as an MCP client posts it, read by the proxy's one body reader (a key
//! named twice is refused: the proxy and the server could read two tool calls), and the
//! headers a 2026-07-28 client mirrors from it (`Mcp-Method`, `Mcp-Name`, `Mcp-Param-*`),
//! checked against it. The headers never identify anything: the body is what executes.

use base64::Engine as _;
use http::HeaderMap;
use serde_json::Value;

use crate::request::body::{BodyError, Parsed};

/// What a message is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A request: it has a method and an id, and gets one response.
    Request,
    /// A method without an id: nothing answers it.
    Notification,
    /// A client's answer to a server's request (elicitation, sampling), or an error.
    Response,
}

/// One message, read.
#[derive(Debug, Clone)]
pub struct Message {
    pub kind: Kind,
    /// The request's id as sent (a string or a number): a replay answers with it.
    pub id: Value,
    pub method: String,
    pub params: Value,
}

/// Why a posted body is not one message the proxy can judge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    #[error("the body is not one JSON-RPC message: {0}")]
    Unreadable(String),
    #[error(transparent)]
    DuplicateKey(BodyError),
    #[error("{0}")]
    InvalidRequest(&'static str),
    #[error("the body is a JSON-RPC batch; MCP over Streamable HTTP sends one message per POST, and the proxy judges each tool call on its own, so a batch is refused")]
    Batch,
    #[error("the header {header} says `{header_value}`, the body says `{body_value}`; the server could act on either, so the request is refused")]
    Mirrored {
        header: String,
        header_value: String,
        body_value: String,
    },
}

impl Message {
    /// Reads a POST body (its content type must be JSON).
    pub fn read(headers: &HeaderMap, body: &[u8]) -> Result<Message, MessageError> {
        match Parsed::parse(headers, body) {
            Ok(Parsed::Json(_)) => {}
            Ok(Parsed::Empty) => return Err(MessageError::Unreadable("it is empty".into())),
            Ok(Parsed::Form(_) | Parsed::Other(_)) => {
                return Err(MessageError::Unreadable(
                    "its content type is not application/json".into(),
                ))
            }
            Err(e @ BodyError::DuplicateKey(_)) => return Err(MessageError::DuplicateKey(e)),
            Err(e) => return Err(MessageError::Unreadable(e.to_string())),
        }
        let value: Value =
            serde_json::from_slice(body).map_err(|e| MessageError::Unreadable(e.to_string()))?;
        let obj = match value {
            Value::Object(obj) => obj,
            Value::Array(_) => return Err(MessageError::Batch),
            _ => return Err(MessageError::Unreadable("it is not an object".into())),
        };
        if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return Err(MessageError::Unreadable("`jsonrpc` is not \"2.0\"".into()));
        }
        let id = obj.get("id").cloned().unwrap_or(Value::Null);
        // An explicit `"id": null` is neither a request (MCP ids are strings or numbers) nor a
        // notification (which has no id): a server may run it as a request, and the proxy
        // would have passed it on unclaimed as a notification.
        if obj.get("id") == Some(&Value::Null) {
            return Err(MessageError::InvalidRequest(
                "`id` is null: a request's id is a string or a number, a notification has none",
            ));
        }
        if !matches!(id, Value::Null | Value::String(_) | Value::Number(_)) {
            return Err(MessageError::Unreadable(
                "`id` is neither a string nor a number".into(),
            ));
        }
        let method = match obj.get("method") {
            None => None,
            Some(Value::String(m)) => Some(m.clone()),
            Some(_) => return Err(MessageError::Unreadable("`method` is not a string".into())),
        };
        if method.as_deref() == Some("tools/call") && id.is_null() {
            return Err(MessageError::InvalidRequest(
                "a tools/call without an id: a tool call is a request, and it needs a string or number id",
            ));
        }
        let kind = match (&method, &id) {
            (Some(_), Value::Null) => Kind::Notification,
            (Some(_), _) => Kind::Request,
            (None, _) => Kind::Response,
        };
        Ok(Message {
            kind,
            id,
            method: method.unwrap_or_default(),
            params: obj.get("params").cloned().unwrap_or(Value::Null),
        })
    }

    pub fn is_tool_call(&self) -> bool {
        self.kind == Kind::Request && self.method == "tools/call"
    }

    /// The named thing a mirrored `Mcp-Name` stands for: a tool's or prompt's name, a
    /// resource's URI, a task's id.
    fn name(&self) -> Option<&str> {
        let field = match self.method.as_str() {
            "resources/read" | "resources/subscribe" | "resources/unsubscribe" => "uri",
            // The tasks extension's requests route by task (2026-07-28).
            "tasks/get" | "tasks/update" | "tasks/cancel" => "taskId",
            _ => "name",
        };
        self.params.get(field).and_then(Value::as_str)
    }

    /// Refuses a message whose mirrored headers say something else than its body. A header
    /// left out is fine (clients of the 2025 revision send none).
    pub fn check_mirrored(&self, headers: &HeaderMap) -> Result<(), MessageError> {
        let mismatch = |header: &str, header_value: &str, body_value: &str| {
            Err(MessageError::Mirrored {
                header: header.to_string(),
                header_value: header_value.to_string(),
                body_value: body_value.to_string(),
            })
        };
        for (name, value) in headers {
            let name = name.as_str();
            let text = decoded(value.as_bytes());
            if name == "mcp-method" {
                if self.kind == Kind::Response || text != self.method {
                    return mismatch("Mcp-Method", &text, &self.method);
                }
            } else if name == "mcp-name" || name == "mcp-tool-name" {
                let body = self.name().unwrap_or("");
                if text != body {
                    return mismatch(name, &text, body);
                }
            } else if name.starts_with("mcp-param-") {
                // The header's name is a token the tool's schema assigns (`x-mcp-header`),
                // not necessarily the argument's name, and it may mirror a nested property:
                // what must hold is that some argument says what the header says.
                let mut values = Vec::new();
                if let Some(args) = self.params.get("arguments") {
                    scalars(args, &mut values);
                }
                if !values.contains(&text) {
                    return mismatch(name, &text, "no argument with that value");
                }
            }
        }
        Ok(())
    }
}

/// Every scalar of `v`, rendered as a client mirrors it into a header (`true`/`false`,
/// numbers as written, strings as they are).
fn scalars(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => map.values().for_each(|v| scalars(v, out)),
        Value::Array(items) => items.iter().for_each(|v| scalars(v, out)),
        Value::String(s) => out.push(s.clone()),
        Value::Null => {}
        other => out.push(other.to_string()),
    }
}

/// The id a refused body's refusal answers: the request's id where one object names one (a
/// key named twice elsewhere still leaves the id readable); `null` otherwise. Only to address
/// the refusal: nothing is ever decided on it.
pub fn refusal_id(body: &[u8], error: &MessageError) -> Value {
    if let MessageError::DuplicateKey(BodyError::DuplicateKey(path)) = error {
        if path == "id" {
            return Value::Null;
        }
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(obj)) => match obj.get("id") {
            Some(id @ (Value::String(_) | Value::Number(_))) => id.clone(),
            _ => Value::Null,
        },
        _ => Value::Null,
    }
}

/// A mirrored header's text: as sent, or decoded from `=?base64?…?=` (how values that are not
/// plain header text are mirrored).
fn decoded(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value).trim().to_string();
    if let Some(inner) = text
        .strip_prefix("=?base64?")
        .and_then(|t| t.strip_suffix("?="))
    {
        if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(inner) {
            if let Ok(s) = String::from_utf8(bytes) {
                return s;
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_headers(extra: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().expect("value"));
        for (k, v) in extra {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
        }
        h
    }

    #[test]
    fn one_message_or_a_reason() {
        let h = json_headers(&[]);
        let call = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"refund","arguments":{"charge":"ch_1"}}}"#;
        let m = Message::read(&h, call).expect("reads");
        assert!(m.is_tool_call());
        assert_eq!(m.id, serde_json::json!(7));
        assert_eq!(
            Message::read(&h, b"[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}]").err(),
            Some(MessageError::Batch)
        );
        let twice =
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","name":"b"}}"#;
        assert!(matches!(
            Message::read(&h, twice),
            Err(MessageError::DuplicateKey(_))
        ));
        assert!(matches!(
            Message::read(&h, b"{not json"),
            Err(MessageError::Unreadable(_))
        ));
        let note = Message::read(
            &h,
            br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        )
        .expect("reads");
        assert_eq!(note.kind, Kind::Notification);
        let answer =
            Message::read(&h, br#"{"jsonrpc":"2.0","id":"s1","result":{}}"#).expect("reads");
        assert_eq!(answer.kind, Kind::Response);
        // A null id is neither a request nor a notification; a tool call always has an id.
        for unclaimable in [
            &br#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"refund"}}"#[..],
            br#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#,
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"refund"}}"#,
        ] {
            assert!(matches!(
                Message::read(&h, unclaimable),
                Err(MessageError::InvalidRequest(_))
            ));
        }
    }

    #[test]
    fn mirrored_headers_must_say_what_the_body_says() {
        let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"refund","arguments":{"charge":"ch_1","amount":5}}}"#;
        let read = |extra: &[(&str, &str)]| {
            let h = json_headers(extra);
            Message::read(&h, body).expect("reads").check_mirrored(&h)
        };
        assert!(read(&[]).is_ok());
        assert!(read(&[
            ("mcp-method", "tools/call"),
            ("mcp-name", "refund"),
            ("mcp-param-charge", "ch_1"),
            ("mcp-param-amount", "5"),
        ])
        .is_ok());
        assert!(read(&[("mcp-param-charge", "=?base64?Y2hfMQ==?=")]).is_ok());
        // The token is the schema's (`x-mcp-header`), not the argument's name.
        assert!(read(&[("mcp-param-charge-id", "ch_1")]).is_ok());
        assert!(read(&[("mcp-method", "tools/list")]).is_err());
        assert!(read(&[("mcp-name", "get_balance")]).is_err());
        assert!(read(&[("mcp-param-charge", "ch_2")]).is_err());
        assert!(read(&[("mcp-param-customer", "cus_1")]).is_err());
        // A task's requests mirror its id (the tasks extension).
        let get = br#"{"jsonrpc":"2.0","id":2,"method":"tasks/get","params":{"taskId":"t-1"}}"#;
        let task = |name: &str| {
            let h = json_headers(&[("mcp-method", "tasks/get"), ("mcp-name", name)]);
            Message::read(&h, get).expect("reads").check_mirrored(&h)
        };
        assert!(task("t-1").is_ok());
        assert!(task("t-2").is_err());
    }
}
