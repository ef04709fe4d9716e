//! Connections a client cannot hold: idle, half-sent and idle keep-alive connections are closed after
//! `--header-timeout`, a body that stops arriving gets 408 after `--body-timeout`, and past `--max-connections` a
//! new connection gets a 503 while the server keeps answering once the others go.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::Duration;

use crate::serve_support::Server;

/// Bounds a hang: far longer than the one-second header timeout these servers run with.
const CLOSE_DEADLINE: Duration = Duration::from_secs(15);

/// Everything the server sends until it closes the connection; panics if it is still open at the deadline.
fn read_until_closed(mut conn: TcpStream, what: &str) -> String {
    conn.set_read_timeout(Some(CLOSE_DEADLINE)).expect("read timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("{what}: still open after {CLOSE_DEADLINE:?} ({e})"),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn idle_half_sent_and_idle_keep_alive_connections_are_closed() {
    let server = Server::start(&["--header-timeout", "1"]);
    let addr = server.client().addr().to_string();
    let idle = TcpStream::connect(&addr).expect("connect");
    let mut half = TcpStream::connect(&addr).expect("connect");
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le").expect("write");
    let mut kept = TcpStream::connect(&addr).expect("connect");
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").expect("write");
    read_until_closed(idle, "an idle connection");
    read_until_closed(half, "a connection that sent half its headers");
    let answered = read_until_closed(kept, "an idle keep-alive connection");
    assert!(answered.starts_with("HTTP/1.1 200"), "the request before the idle wait was answered: {answered:?}");
    server.client().assert_healthy("closing slow connections");
}

#[test]
fn past_the_connection_limit_a_new_connection_gets_503_and_the_server_recovers() {
    let server = Server::start(&["--max-connections", "3", "--header-timeout", "60"]);
    let addr = server.client().addr().to_string();
    let held: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&addr).expect("connect")).collect();
    // The server takes connections in as it accepts them; give it a moment to take all three.
    thread::sleep(Duration::from_millis(300));
    let mut extra = TcpStream::connect(&addr).expect("connect");
    extra.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").expect("write");
    let refused = read_until_closed(extra, "a connection past the limit");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused:?}");
    assert!(refused.contains("\"code\":\"overloaded\"") && refused.contains("retry-after: 1"), "{refused:?}");
    // The log line may still be on its way through the pipe.
    let logged = (0..40).any(|_| {
        let found = server.logs().contains("refused with 503");
        if !found {
            thread::sleep(Duration::from_millis(50));
        }
        found
    });
    assert!(logged, "{}", server.logs().tail());
    drop(held);
    thread::sleep(Duration::from_millis(300));
    server.client().assert_healthy("the held connections closing");
}

#[test]
fn a_body_that_stops_arriving_gets_408() {
    let server = Server::start(&["--body-timeout", "1"]);
    let mut conn = TcpStream::connect(server.client().addr()).expect("connect");
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
                Content-Length: 200\r\n\r\n";
    conn.write_all(head.as_bytes()).expect("write");
    conn.write_all(br#"{"messages": [{"role": "#).expect("write");
    let answer = read_until_closed(conn, "a request whose body stopped");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    server.client().assert_healthy("a stalled body");
}
