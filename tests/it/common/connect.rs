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
