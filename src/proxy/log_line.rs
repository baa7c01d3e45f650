//! The one log line of a protected request (`trace::Trace::finish`), and how it reaches the
//! log. Through tracing's own field formatter, its thirteen fields cost more than anything
//! else a replay does but SHA-256 (a `write!` per field, each name and `=` painted in a
//! style that is empty without colours). In the plain text format — what a proxy writes
//! to a file or a journal — the fields part is therefore written here, in one piece, as one
//! field that [`LineFields`] writes as it stands, byte for byte what tracing's
//! `DefaultFields` writes for the fields (`tests::the_line_reads_as_tracing_writes_it`).
//! JSON logs, a terminal's colours and any subscriber a library user installs get the
//! fields as fields.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{RecordFields, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};
use tracing_subscriber::fmt::FormatFields;

/// Where the line has always come from: filters name it (`idemproxy::proxy::trace=warn`).
const TARGET: &str = "idemproxy::proxy::trace";

/// The field that holds the whole line; no other event has it. The log writer takes a line
/// with it as already redacted, so every caller-derived value is redacted here.
const LINE_FIELD: &str = crate::redact::REDACTED_LINE_FIELD;

/// Set once the subscriber formats fields with [`LineFields`] (`write_lines_whole`).
static WHOLE: AtomicBool = AtomicBool::new(false);

/// From now on the line goes to the log as one field: call once the subscriber's field
/// formatter is [`LineFields`], in the plain text format without colours (where it writes the
/// same bytes as the fields would).
pub fn write_lines_whole() {
    WHOLE.store(true, Ordering::Relaxed);
}

/// What one protected request did, as its log line says it.
pub struct Line<'a> {
    pub route: &'a str,
    pub tenant: &'a str,
    pub scope: &'a str,
    pub key_source: &'a str,
    pub operation: &'a str,
    pub outcome: &'a str,
    pub unprotected: Option<&'a str>,
    pub spend: Option<&'a str>,
    pub status: u16,
    pub upstream_status: Option<u16>,
    pub forward_ms: Option<u64>,
    pub total_ms: u64,
}

impl Line<'_> {
    pub fn log(&self) {
        // Inside a span, the span's fields join the line: it then goes as fields, and the log
        // writer scans it like any other line (the whole line is taken as redacted).
        if WHOLE.load(Ordering::Relaxed) && tracing::Span::current().is_none() {
            self.log_whole();
        } else {
            self.log_fields();
        }
    }

    /// As tracing fields (JSON, colours, other subscribers).
    fn log_fields(&self) {
        tracing::info!(
            target: TARGET,
            route = %self.route,
            tenant = %self.tenant,
            scope = %self.scope,
            key_source = self.key_source,
            operation = self.operation,
            outcome = %self.outcome,
            unprotected = self.unprotected,
            spend = self.spend,
            status = self.status,
            upstream_status = self.upstream_status,
            forward_ms = self.forward_ms,
            total_ms = self.total_ms,
            "protected request"
        );
    }

    /// As one field, written by [`LineFields`] straight into tracing's line buffer (this
    /// `Display` runs only when the line is written, never when a filter drops it).
    fn log_whole(&self) {
        tracing::info!(target: TARGET, idemproxy_protected_request = %self);
    }
}

/// Exactly what tracing's `DefaultFields` writes for `log_fields`' fields without colours: the
/// message, then `name=value` separated by spaces, `%` fields as `Display`, strings as
/// `Debug` (quoted, escaped), numbers in decimal, an absent `Option` left out.
impl fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut n = itoa::Buffer::new();
        f.write_str("protected request route=")?;
        f.write_str(self.route)?;
        f.write_str(" tenant=")?;
        f.write_str(self.tenant)?;
        // The scope and the operation are derived from the caller's request; the rest is
        // the operator's names, the proxy's own words and numbers.
        f.write_str(" scope=")?;
        f.write_str(&crate::redact::log_value(self.scope))?;
        f.write_str(" key_source=")?;
        quoted(f, self.key_source)?;
        f.write_str(" operation=")?;
        quoted(f, &crate::redact::log_value(self.operation))?;
        f.write_str(" outcome=")?;
        f.write_str(self.outcome)?;
        if let Some(why) = self.unprotected {
            f.write_str(" unprotected=")?;
            quoted(f, why)?;
        }
        if let Some(spend) = self.spend {
            f.write_str(" spend=")?;
            quoted(f, spend)?;
        }
        f.write_str(" status=")?;
        f.write_str(n.format(self.status))?;
        if let Some(status) = self.upstream_status {
            f.write_str(" upstream_status=")?;
            f.write_str(n.format(status))?;
        }
        if let Some(ms) = self.forward_ms {
            f.write_str(" forward_ms=")?;
            f.write_str(n.format(ms))?;
        }
        f.write_str(" total_ms=")?;
        f.write_str(n.format(self.total_ms))
    }
}

/// The line of one MCP tool call (`proxy::mcp`), composed whole as [`Line`] is: the same
/// bytes as its fields, the caller-derived values (scope, tool) redacted here.
pub struct ToolCallLine<'a> {
    pub route: &'a str,
    pub tenant: &'a str,
    pub scope: &'a str,
    pub tool: &'a str,
    pub key_source: &'a str,
    pub outcome: &'a str,
}

/// Where the tool call's line has always come from.
const TOOL_CALL_TARGET: &str = "idemproxy::proxy::mcp";

impl ToolCallLine<'_> {
    pub fn log(&self) {
        if WHOLE.load(Ordering::Relaxed) && tracing::Span::current().is_none() {
            tracing::info!(target: TOOL_CALL_TARGET, idemproxy_protected_request = %self);
        } else {
            self.log_fields();
        }
    }

    fn log_fields(&self) {
        tracing::info!(
            target: TOOL_CALL_TARGET,
            route = %self.route,
            tenant = %self.tenant,
            scope = %self.scope,
            tool = %self.tool,
            key_source = self.key_source,
            outcome = self.outcome,
            "a tool call"
        );
    }
}

impl fmt::Display for ToolCallLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a tool call route=")?;
        f.write_str(self.route)?;
        f.write_str(" tenant=")?;
        f.write_str(self.tenant)?;
        f.write_str(" scope=")?;
        f.write_str(&crate::redact::log_value(self.scope))?;
        f.write_str(" tool=")?;
        f.write_str(&crate::redact::log_value(self.tool))?;
        f.write_str(" key_source=")?;
        quoted(f, self.key_source)?;
        f.write_str(" outcome=")?;
        quoted(f, self.outcome)
    }
}

/// A string as `Debug` writes it; most are plain words, which need no escaping.
fn quoted(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    let plain = s
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\' || b == b' ');
    if plain {
        f.write_char('"')?;
        f.write_str(s)?;
        f.write_char('"')
    } else {
        write!(f, "{s:?}")
    }
}

/// tracing's `DefaultFields`, but the one field holding a whole line is written as it
/// stands. Every other event and span is formatted by `DefaultFields`' own visitor.
#[derive(Debug, Default)]
pub struct LineFields;

impl<'w> FormatFields<'w> for LineFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut v = WholeOrDefault {
            inner: DefaultVisitor::new(writer, true),
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result.and(v.inner.finish())
    }
}

struct WholeOrDefault<'w> {
    inner: DefaultVisitor<'w>,
    result: fmt::Result,
}

impl Visit for WholeOrDefault<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == LINE_FIELD {
            self.result = self.result.and(write!(self.inner.writer(), "{value:?}"));
        } else {
            self.inner.record_debug(field, value);
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.inner.record_str(field, value);
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.inner.record_error(field, value);
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.inner.record_f64(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.inner.record_i64(field, value);
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.inner.record_u64(field, value);
    }

    fn record_i128(&mut self, field: &Field, value: i128) {
        self.inner.record_i128(field, value);
    }

    fn record_u128(&mut self, field: &Field, value: u128) {
        self.inner.record_u128(field, value);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.inner.record_bool(field, value);
    }

    fn record_bytes(&mut self, field: &Field, value: &[u8]) {
        self.inner.record_bytes(field, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// What a subscriber wrote, kept for the test to read.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Captured {
            self.clone()
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().expect("lock").clone()).expect("utf-8")
        }
    }

    /// A fixed time, so two lines written at different moments can be compared whole.
    struct Noon;

    impl tracing_subscriber::fmt::time::FormatTime for Noon {
        fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
            w.write_str("2026-12-02T12:00:00.000000Z")
        }
    }

    /// The lines `emit` writes through the subscriber `main` installs for plain text logs,
    /// with tracing's own field formatter (`whole` false) or with `LineFields`.
    fn written(whole: bool, emit: impl Fn()) -> String {
        let out = Captured::default();
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_timer(Noon)
            .with_writer(out.clone());
        if whole {
            tracing::subscriber::with_default(builder.fmt_fields(LineFields).finish(), emit);
        } else {
            tracing::subscriber::with_default(builder.finish(), emit);
        }
        out.text()
    }

    fn lines() -> Vec<Line<'static>> {
        let replay = Line {
            route: "stripe",
            tenant: "default",
            scope: "idem:default:d842740001cc0f366d23676ca4d58e84ddbb70de5fb2e26f8042dd91d0bd9f45",
            key_source: "client",
            operation: "-",
            outcome: "replayed",
            unprotected: None,
            spend: None,
            status: 200,
            upstream_status: None,
            forward_ms: None,
            total_ms: 0,
        };
        vec![
            Line {
                outcome: "forwarded",
                key_source: "template",
                operation: "refund",
                spend: Some("reserved 20.00 usd"),
                upstream_status: Some(201),
                forward_ms: Some(37),
                total_ms: 41,
                ..replay
            },
            Line {
                scope: "-",
                key_source: "-",
                outcome: "unprotected",
                unprotected: Some("no key: the request carries no idempotency-key header"),
                upstream_status: Some(502),
                status: 502,
                total_ms: 1234567,
                ..replay
            },
            Line {
                outcome: "rejected",
                status: 422,
                spend: Some("over_cap"),
                ..replay
            },
            Line {
                route: "ünïcode route",
                tenant: "team\"a\\",
                operation: "quote\"back\\slash\ttab\u{1b}[31mred\u{7f}é\u{200b}",
                unprotected: Some("a\nnew line"),
                forward_ms: Some(u64::MAX),
                upstream_status: Some(u16::MAX),
                ..replay
            },
            replay,
        ]
    }

    #[test]
    fn the_line_reads_as_tracing_writes_it() {
        for line in lines() {
            let fields = written(false, || line.log_fields());
            let whole = written(true, || line.log_whole());
            assert!(fields.contains("protected request route="), "{fields}");
            assert!(
                fields.starts_with("2026-12-02T12:00:00.000000Z  INFO idemproxy::proxy::trace: ")
            );
            assert_eq!(whole, fields);
        }
    }

    #[test]
    fn other_events_and_spans_read_as_tracing_writes_them() {
        let emit = || {
            let span = tracing::info_span!("conn", peer = %"127.0.0.1:4000", n = 3);
            let _in = span.enter();
            tracing::warn!(route = "r", error = %"store down", "store unavailable; forwarding");
            tracing::info!(scope = "s", derivation = 1u8, ok = true, f = 0.5, "claimed");
            let e = std::io::Error::other("boom");
            tracing::error!(error = &e as &(dyn std::error::Error + 'static), "failed");
            tracing::info!("a message with \u{1b}[31m an escape");
        };
        let fields = written(false, emit);
        assert_eq!(fields.lines().count(), 4, "{fields}");
        assert_eq!(written(true, emit), fields);
    }

    #[test]
    fn caller_derived_values_are_redacted_where_the_line_is_composed() {
        let line = Line {
            operation: "tools/call refund sk_live_0123456789abcdef",
            scope: "idem:t:4242424242424242",
            ..lines().remove(0)
        };
        let whole = line.to_string();
        assert!(!whole.contains("sk_live_0123456789abcdef"), "{whole}");
        assert!(!whole.contains("4242424242424242"), "{whole}");
        assert!(
            whole.contains(" route=") && whole.contains(" status="),
            "{whole}"
        );
    }

    #[test]
    fn inside_a_span_the_line_goes_as_fields_and_is_scanned() {
        write_lines_whole();
        let out = Captured::default();
        let (writer, guard) = crate::log_writer::spawn(out.clone()).expect("log thread");
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer)
            .fmt_fields(LineFields)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("conn", peer = %"sk_live_inaspan");
            let _in = span.enter();
            lines()[0].log();
        });
        drop(guard);
        let text = out.text();
        assert!(text.contains("protected request route=stripe"), "{text}");
        assert!(!text.contains("sk_live_inaspan"), "{text}");
    }

    #[test]
    fn the_tool_call_line_reads_as_tracing_writes_it() {
        for tool in [
            "refund",
            "quote\"back\\slash\ttab\u{1b}[31m",
            "ünïcode tool",
        ] {
            let line = ToolCallLine {
                route: "mcp",
                tenant: "default",
                scope:
                    "mcp:default:d842740001cc0f366d23676ca4d58e84ddbb70de5fb2e26f8042dd91d0bd9f45",
                tool,
                key_source: "arguments",
                outcome: "replayed",
            };
            let fields = written(false, || line.log_fields());
            let whole = written(
                true,
                || tracing::info!(target: TOOL_CALL_TARGET, idemproxy_protected_request = %line),
            );
            assert!(fields.contains("a tool call route=mcp"), "{fields}");
            assert_eq!(whole, fields);
        }
        let secret = ToolCallLine {
            route: "mcp",
            tenant: "default",
            scope: "s",
            tool: "sk_live_0123456789abcdef",
            key_source: "arguments",
            outcome: "executed",
        };
        assert!(!secret.to_string().contains("sk_live_0123456789abcdef"));
    }

    #[test]
    fn json_logs_keep_the_fields() {
        let out = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(out.clone())
            .finish();
        let line = &lines()[0];
        tracing::subscriber::with_default(subscriber, || line.log_fields());
        let v: serde_json::Value = serde_json::from_str(out.text().trim()).expect("json");
        let f = &v["fields"];
        assert_eq!(f["message"], "protected request");
        assert_eq!(f["outcome"], "forwarded");
        assert_eq!(f["upstream_status"], 201);
        assert_eq!(v["target"], TARGET);
    }
}
