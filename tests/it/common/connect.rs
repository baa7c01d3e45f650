//! A raw `CONNECT` client: opens a tunnel through the proxy, then (optionally) TLS over it,
//! so tests can look at exactly which certificate came back and send requests through it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::client::Reply;

/// The proxy's answer to a CONNECT: status, head, and the stream after the head.
pub struct Connected {
    pub status: u16,
    pub head: String,
    pub stream: TcpStream,
}

/// Sends `CONNECT authority HTTP/1.1` (the request line is sent as given, so tests can send
/// malformed ones) and reads the response head.
pub async fn connect(proxy: SocketAddr, authority: &str) -> Result<Connected, String> {
    let mut stream = TcpStream::connect(proxy)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut byte))
            .await
            .map_err(|_| "no CONNECT answer within 20s".to_string())?
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err(format!(
                "proxy closed after {:?}",
                String::from_utf8_lossy(&head)
            ));
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line: {head}"))?;
    Ok(Connected {
        status,
        head,
        stream,
    })
}

/// CONNECT, then a TLS handshake for `server_name` trusting `client`'s roots. Returns the
/// stream and the leaf certificate the server presented.
pub async fn tls(
    proxy: SocketAddr,
    authority: &str,
    server_name: &str,
    client: Arc<rustls::ClientConfig>,
) -> Result<(TlsStream<TcpStream>, CertificateDer<'static>), String> {
    let c = connect(proxy, authority).await?;
    if c.status != 200 {
        return Err(format!("CONNECT answered {}", c.head));
    }
    tls_over(c.stream, server_name, client).await
}

/// A TLS handshake for `server_name` over an open tunnel.
pub async fn tls_over(
    stream: TcpStream,
    server_name: &str,
    client: Arc<rustls::ClientConfig>,
) -> Result<(TlsStream<TcpStream>, CertificateDer<'static>), String> {
    let name = ServerName::try_from(server_name.to_string()).map_err(|e| e.to_string())?;
    let stream = tokio::time::timeout(
        Duration::from_secs(20),
        tokio_rustls::TlsConnector::from(client).connect(name, stream),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_string())?
    .map_err(|e| format!("TLS handshake: {e}"))?;
    let leaf = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .cloned()
        .ok_or("no peer certificate")?;
    Ok((stream, leaf))
}

/// One HTTP/1.1 request over an established (TLS) stream.
pub async fn request<S>(
    stream: S,
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Reply, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    super::client::exchange(
        stream,
        method,
        path,
        host,
        headers,
        Bytes::from(body.to_string()),
    )
    .await
}

/// What a raw client got from one attempt through the proxy: the CONNECT status, then (for a
/// 200) whether its TLS handshake completed and the HTTP answer it read.
#[derive(Debug)]
pub struct Attempt {
    pub connect_status: u16,
    pub connect_head: String,
    /// The handshake or exchange failed (the proxy closed the tunnel, a bad certificate…).
    pub failed: Option<String>,
    /// Status, head and body of the answer, when one came.
    pub answer: Option<(u16, String, Vec<u8>)>,
    /// The leaf certificate the other end presented.
    pub leaf: Option<CertificateDer<'static>>,
}

impl Attempt {
    /// The answer came from the proxy's pipeline (it marks protected answers).
    pub fn intercepted(&self) -> bool {
        self.answer.as_ref().is_some_and(|(_, head, _)| {
            head.to_ascii_lowercase().contains("idempotent-replayed:")
                || head.to_ascii_lowercase().contains("x-idemproxy-error:")
        })
    }

    pub fn status(&self) -> Option<u16> {
        self.answer.as_ref().map(|(s, _, _)| *s)
    }
}

/// How a raw client shapes its ClientHello.
#[derive(Debug, Clone)]
pub struct Hello {
    /// The name sent as SNI; `None` sends none (the client addresses the server by IP).
    pub sni: Option<String>,
    /// Split the ClientHello into TLS records of this many bytes, each sent in two TCP writes
    /// 20 ms apart (the record header itself split), so the proxy must reassemble it.
    pub fragment: Option<usize>,
}

/// CONNECT `authority`, then TLS as `hello` says (a rustls client driven by hand, so the
/// ClientHello can be split), then one HTTP/1.1 request with `host` in the Host header.
/// Blocking: run it with `spawn_blocking`.
pub fn raw_attempt(
    proxy: SocketAddr,
    authority: &str,
    hello: &Hello,
    client: Arc<rustls::ClientConfig>,
    request: &str,
) -> Attempt {
    use std::io::{Read, Write};
    let mut attempt = Attempt {
        connect_status: 0,
        connect_head: String::new(),
        failed: None,
        answer: None,
        leaf: None,
    };
    let mut tcp = std::net::TcpStream::connect(proxy).expect("connect to the proxy");
    tcp.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("read timeout");
    let _ = tcp.set_nodelay(true);
    tcp.write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .expect("write CONNECT");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match tcp.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            other => {
                attempt.failed = Some(format!("CONNECT answer cut off: {other:?}"));
                return attempt;
            }
        }
    }
    attempt.connect_head = String::from_utf8_lossy(&head).into_owned();
    attempt.connect_status = attempt
        .connect_head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if attempt.connect_status != 200 {
        return attempt;
    }
    let name = match &hello.sni {
        Some(n) => ServerName::try_from(n.clone()).expect("server name"),
        None => ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
    };
    let mut conn = rustls::ClientConnection::new(client, name).expect("client connection");
    if let Some(size) = hello.fragment {
        let mut first = Vec::new();
        conn.write_tls(&mut first).expect("ClientHello");
        for piece in refragment(&first, size) {
            let (a, b) = piece.split_at(3.min(piece.len()));
            for part in [a, b] {
                if tcp.write_all(part).is_err() {
                    attempt.failed = Some("the proxy closed during the ClientHello".into());
                    return attempt;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    let mut stream = rustls::Stream::new(&mut conn, &mut tcp);
    let exchange = (|| -> std::io::Result<Vec<u8>> {
        stream.write_all(request.as_bytes())?;
        stream.flush()?;
        let mut got = Vec::new();
        match stream.read_to_end(&mut got) {
            Ok(_) => Ok(got),
            // A server that closes without close_notify still sent a whole answer.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !got.is_empty() => Ok(got),
            Err(e) => Err(e),
        }
    })();
    attempt.leaf = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .cloned()
        .map(|c| c.into_owned());
    match exchange {
        Err(e) => attempt.failed = Some(e.to_string()),
        Ok(bytes) => {
            let split = bytes
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|i| i + 4)
                .unwrap_or(bytes.len());
            let head = String::from_utf8_lossy(&bytes[..split]).into_owned();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            attempt.answer = Some((status, head, bytes[split..].to_vec()));
        }
    }
    attempt
}

/// The handshake records in `flight` re-cut into records of at most `size` payload bytes.
pub fn refragment(flight: &[u8], size: usize) -> Vec<Vec<u8>> {
    let mut payload = Vec::new();
    let mut version = [3u8, 1];
    let mut rest = flight;
    while rest.len() >= 5 {
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        assert_eq!(rest[0], 22, "the first flight is handshake records");
        version = [rest[1], rest[2]];
        payload.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
    }
    payload
        .chunks(size.max(1))
        .map(|chunk| {
            let mut record = vec![22, version[0], version[1]];
            record.extend_from_slice(&u16::try_from(chunk.len()).expect("small").to_be_bytes());
            record.extend_from_slice(chunk);
            record
        })
        .collect()
}

/// `GET path` over an open (TLS) stream to the fake provider's `/stream`, and when each chunk
/// of the answer arrived, from the moment the request was sent: a tunnel or a passthrough that
/// buffers shows as chunks arriving together.
pub async fn chunk_arrivals<S>(stream: S, host: &str, path: &str) -> Vec<Duration>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("h1 over the stream");
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", host)
        .body(http_body_util::Empty::<Bytes>::new())
        .expect("request");
    let started = std::time::Instant::now();
    let mut body = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        if frame.expect("frame").is_data() {
            arrivals.push(started.elapsed());
        }
    }
    arrivals
}
