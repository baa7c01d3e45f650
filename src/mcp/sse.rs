//! Server-sent events as an MCP server streams them, read incrementally: the bytes pass on to
//! the client as they come, and the proxy reads the same bytes to find the call's final
//! response among progress notifications and server requests.

/// One event: its `id`, `event` type (`message` when absent) and its data lines joined.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Event {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// Reads events out of chunks as they arrive; a line may span chunks.
#[derive(Default)]
pub struct Reader {
    line: Vec<u8>,
    /// The previous chunk ended in `\r`: a `\n` starting this one belongs to it.
    after_cr: bool,
    current: Event,
    has_data: bool,
}

/// Longest line kept: a server streaming one endless line is cut off, not buffered whole.
const MAX_LINE: usize = 16 * 1024 * 1024;

impl Reader {
    /// The events `chunk` completes.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        for &b in chunk {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(e) = self.line_done(&line) {
                        events.push(e);
                    }
                }
                _ if self.line.len() < MAX_LINE => self.line.push(b),
                _ => {}
            }
        }
        events
    }

    fn line_done(&mut self, line: &[u8]) -> Option<Event> {
        if line.is_empty() {
            let done = std::mem::take(&mut self.current);
            let had = std::mem::replace(&mut self.has_data, false);
            return had.then_some(done);
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((f, v)) => (f.to_string(), v.strip_prefix(' ').unwrap_or(v).to_string()),
            None => (text.to_string(), String::new()),
        };
        match field.as_str() {
            "data" => {
                if self.has_data {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(&value);
                self.has_data = true;
            }
            "event" => self.current.event = Some(value),
            "id" => self.current.id = Some(value),
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_across_chunks_and_line_endings() {
        let mut r = Reader::default();
        let mut all = r.feed(b"id: 1\r\nevent: message\r\ndata: {\"a\"");
        assert!(all.is_empty());
        all.extend(r.feed(b":1}\r"));
        all.extend(r.feed(b"\n\r\n: comment\n\ndata: x\ndata: y\n\n"));
        assert_eq!(
            all,
            vec![
                Event {
                    id: Some("1".into()),
                    event: Some("message".into()),
                    data: "{\"a\":1}".into()
                },
                Event {
                    id: None,
                    event: None,
                    data: "x\ny".into()
                }
            ]
        );
    }

    #[test]
    fn a_priming_event_without_data_is_no_message() {
        let mut r = Reader::default();
        assert!(r.feed(b"id: p0\ndata:\n\n").len() == 1);
        let mut r = Reader::default();
        assert!(r.feed(b"id: p0\nretry: 100\n\n").is_empty());
    }
}
