//! What the listener does when it is full: a short 503 instead of an unbounded queue.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FULL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nx-idemproxy-error: too-many-connections\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: 163\r\n\r\n{\"type\":\"urn:idemproxy:problem:too-many-connections\",\"title\":\"Too many connections\",\"status\":503,\"detail\":\"The proxy is at server.max_connections. Retry shortly.\"}";

/// Answers 503 and closes. Nothing was forwarded or claimed. The request head is read
/// first (briefly, boundedly): clients treat an answer that arrives before their request as a
/// broken connection, and closing with unread bytes makes the kernel send a reset that can
/// destroy the 503 before the client reads it.
pub async fn refuse_connection(mut stream: TcpStream) {
    tracing::warn!("refusing a connection: server.max_connections reached");
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while head.len() < 64 * 1024 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let _ = stream.write_all(FULL).await;
        let _ = stream.shutdown().await;
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn content_length_matches_the_body() {
        let text = std::str::from_utf8(super::FULL).expect("ascii");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{}",
            body.len()
        );
        assert!(serde_json::from_str::<serde_json::Value>(body).is_ok());
    }
}
