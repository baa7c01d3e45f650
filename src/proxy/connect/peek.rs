//! The first bytes of a tunnel, read before the proxy decides what to do with it (squid's
//! "peek" step): the client's ClientHello, reassembled up to a bound, or silence from a
//! client that waits for the server to speak first (SMTP, SSH). Everything read is kept to
//! be replayed, byte for byte, to whoever gets the connection ([`super::replay::Replay`]).

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

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

/// Reads until the bytes are a whole ClientHello or something else, all within `whole`. Until
/// the first byte comes, `server_spoke` ending (the first-byte timeout, or the server's own
/// first bytes) means the client waits for the server: [`Seen::Silence`].
pub async fn peek<IO, S>(io: &mut IO, server_spoke: S, whole: Duration) -> Peeked
where
    IO: AsyncRead + Unpin,
    S: Future<Output = ()>,
{
    let deadline = tokio::time::Instant::now() + whole;
    let mut bytes = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    tokio::pin!(server_spoke);
    loop {
        let room = MAX_HELLO_BYTES.saturating_sub(bytes.len()).min(chunk.len());
        let read = tokio::select! {
            read = tokio::time::timeout_at(deadline, io.read(&mut chunk[..room])) => Some(read),
            () = &mut server_spoke, if bytes.is_empty() => None,
        };
        let seen = match read {
            None => Some(Seen::Silence),
            Some(Err(_)) if bytes.is_empty() => Some(Seen::Silence),
            Some(Err(_)) => Some(Seen::Malformed("the ClientHello stalled")),
            Some(Ok(Ok(0)) | Ok(Err(_))) => Some(Seen::Closed),
            Some(Ok(Ok(n))) => {
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

/// Bounds a first flight that has begun but never ends while the server keeps talking (the
/// idle timeout covers a quiet server).
const FIRST_FLIGHT_BOUND: Duration = Duration::from_secs(24 * 3600);

/// A peek at a client that said nothing at first (a server-first protocol, or a client biding
/// its time): the server's bytes pass to the client as they come, while the client's first
/// bytes are read and kept, not forwarded, until they are a whole ClientHello or something
/// else. Nothing from the server for `idle` ends it as [`Seen::Silence`], as an idle tunnel
/// would end; `io` comes back whole, with nothing of it lost.
pub async fn peek_while_server_speaks<IO>(
    io: IO,
    upstream: &mut TcpStream,
    idle: Duration,
) -> (Peeked, IO)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let (mut client_reads, mut client_writes) = tokio::io::split(io);
    let mut buf = vec![0u8; 16 * 1024];
    let mut server_open = true;
    let mut quiet_until = tokio::time::Instant::now() + idle;
    let peeked = {
        let peeking = peek(
            &mut client_reads,
            std::future::pending(),
            FIRST_FLIGHT_BOUND,
        );
        tokio::pin!(peeking);
        loop {
            tokio::select! {
                peeked = &mut peeking => break peeked,
                // Reads are cancel-safe; a write, once begun, finishes before the next poll.
                read = upstream.read(&mut buf), if server_open => match read {
                    // The server closed its side: the splice (if any) passes that on.
                    Ok(0) | Err(_) => server_open = false,
                    Ok(n) => {
                        if client_writes.write_all(&buf[..n]).await.is_err() {
                            break Peeked { bytes: Vec::new(), seen: Seen::Closed };
                        }
                        quiet_until = tokio::time::Instant::now() + idle;
                    }
                },
                () = tokio::time::sleep_until(quiet_until) => {
                    break Peeked { bytes: Vec::new(), seen: Seen::Silence };
                }
            }
        }
    };
    (peeked, client_reads.unsplit(client_writes))
}
