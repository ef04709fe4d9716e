//! The HTTP listener: accepts connections up to `--max-connections` and serves each over HTTP/1.1 with a header
//! timeout, which also bounds how long a keep-alive connection may sit idle, so idle or slow clients cannot use up
//! the server's sockets. Past the limit a new connection gets a 503 and is closed.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// What one client may hold.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Open connections at most; past it new ones are answered 503 and closed.
    pub max_connections: usize,
    /// Time a connection has to send a request's headers, counted from when the server starts reading them: on a
    /// new connection, and on a keep-alive one once the previous response is out.
    pub header_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting and waits for the open connections:
/// in-flight requests finish, idle keep-alive connections close.
///
/// # Errors
/// None today: a failed accept (out of file descriptors, say) is logged and retried.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut shed = ShedLog::new(limits.max_connections);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            shed.refused();
            tokio::spawn(refuse(stream));
            continue;
        };
        let mut builder = http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
        let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection from {peer}: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A 503 in OpenAI's error shape on a connection past the limit, then the close; a client that does not read it
/// within a second is dropped.
async fn refuse(mut stream: TcpStream) {
    const BODY: &str = r#"{"error":{"message":"the server has too many open connections, please retry later","type":"server_error","param":null,"code":"overloaded"}}"#;
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let write = async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// One warning a second at most while connections are refused, with how many were.
struct ShedLog {
    limit: usize,
    last: Option<Instant>,
    unreported: u64,
}

impl ShedLog {
    fn new(limit: usize) -> Self {
        ShedLog { limit, last: None, unreported: 0 }
    }

    fn refused(&mut self) {
        self.unreported += 1;
        if self.last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            tracing::warn!(
                "{} connection(s) refused with 503: {} are open (--max-connections)",
                self.unreported,
                self.limit
            );
            self.last = Some(Instant::now());
            self.unreported = 0;
        }
    }
}
