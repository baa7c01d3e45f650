//! A connection with the bytes already read from it put back in front, so the peek at a
//! tunnel's first bytes is invisible to whoever reads it next (rustls, or the upstream of a
//! blind tunnel).

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub struct Replay<IO> {
    front: Vec<u8>,
    /// How much of `front` has been read again.
    at: usize,
    io: IO,
}

impl<IO> Replay<IO> {
    pub fn new(front: Vec<u8>, io: IO) -> Replay<IO> {
        Replay { front, at: 0, io }
    }

    /// Puts `read` back in front: bytes read through this connection after it was made,
    /// which came before whatever of the old front is still unread.
    pub fn put_back(mut self, mut read: Vec<u8>) -> Replay<IO> {
        read.extend_from_slice(&self.front[self.at..]);
        self.front = read;
        self.at = 0;
        self
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Replay<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at < self.front.len() && buf.remaining() > 0 {
            let n = buf.remaining().min(self.front.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.front[at..at + n]);
            self.at += n;
            if self.at == self.front.len() {
                self.front = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Replay<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn the_front_comes_back_exactly_then_the_rest() {
        let rest: &[u8] = b" world";
        let mut r = Replay::new(b"hello".to_vec(), rest);
        let mut small = [0u8; 3];
        r.read_exact(&mut small).await.expect("read");
        assert_eq!(&small, b"hel");
        let mut all = Vec::new();
        r.read_to_end(&mut all).await.expect("read");
        assert_eq!(all, b"lo world");
    }

    #[tokio::test]
    async fn bytes_put_back_come_before_the_unread_front() {
        let rest: &[u8] = b"!";
        let mut r = Replay::new(b"abcdef".to_vec(), rest);
        let mut first = [0u8; 2];
        r.read_exact(&mut first).await.expect("read");
        let mut r = r.put_back(first.to_vec());
        let mut all = Vec::new();
        r.read_to_end(&mut all).await.expect("read");
        assert_eq!(all, b"abcdef!");
    }
}
