//! The first bytes of a tunnel, read before the proxy decides what to do with it (squid's
//! "peek" step): the client's ClientHello, reassembled up to a bound, or silence from a
//! client that waits for the server to speak first (SMTP, SSH). Everything read is kept to
//! be replayed, byte for byte, to whoever gets the connection ([`super::replay::Replay`]).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::tls::client_hello::{self, ClientHello, Hello, MAX_HELLO_BYTES};

/// What the client sent first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Nothing within the first-byte timeout: the server speaks first.
    Silence,
    Hello(ClientHello),
    /// Its first byte is not a TLS handshake record (plain HTTP, an SSH client…).
    NotTls,
    /// TLS, but no well-formed ClientHello within the bound or the time.
    Malformed(&'static str),
    /// The client closed (or the read failed) before a whole ClientHello.
    Closed,
}

/// What was read and what it is.
pub struct Peeked {
    pub bytes: Vec<u8>,
    pub seen: Seen,
}

/// Reads until the bytes are a whole ClientHello or something else: the first byte within
/// `first_byte`, the rest within `whole` from the start.
pub async fn peek<IO: AsyncRead + Unpin>(
    io: &mut IO,
    first_byte: Duration,
    whole: Duration,
) -> Peeked {
    let started = tokio::time::Instant::now();
    let mut bytes = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        let deadline = if bytes.is_empty() {
            started + first_byte
        } else {
            started + whole
        };
        let room = MAX_HELLO_BYTES.saturating_sub(bytes.len()).min(chunk.len());
        let read = tokio::time::timeout_at(deadline, io.read(&mut chunk[..room])).await;
        let seen = match read {
            Err(_) if bytes.is_empty() => Some(Seen::Silence),
            Err(_) => Some(Seen::Malformed("the ClientHello stalled")),
            Ok(Ok(0)) | Ok(Err(_)) => Some(Seen::Closed),
            Ok(Ok(n)) => {
                bytes.extend_from_slice(&chunk[..n]);
                match client_hello::parse(&bytes) {
                    Hello::Incomplete => None,
                    Hello::ClientHello(h) => Some(Seen::Hello(h)),
                    Hello::NotTls => Some(Seen::NotTls),
                    Hello::Malformed(why) => Some(Seen::Malformed(why)),
                }
            }
        };
        if let Some(seen) = seen {
            return Peeked { bytes, seen };
        }
    }
}
