//! Servers whose flags or fate differ from the shared one: a queue that fills up, a graceful shutdown, a request
//! its grace period cuts (503), and a second signal that cuts the grace period short.

use std::sync::Barrier;
use std::thread;
use std::time::Duration;

use serde_json::json;

use crate::idle;
use crate::serve_support::{chat, wait_for_metrics, Api, Reply, Server, Streamed, Whole};

/// How long a server may take to exit after SIGTERM, in-flight work included.
const EXIT_DEADLINE: Duration = Duration::from_secs(15);

#[test]
fn a_full_queue_answers_503_with_retry_after_and_the_rest_succeed() {
    let server = Server::start(&["--max-concurrent", "1", "--max-queue", "1"]);
    let client = server.client();
    let body = chat("Tell me a long story about a dragon.", json!({"max_tokens": 200, "ignore_eos": true}));
    let barrier = Barrier::new(6);
    let replies: Vec<Reply> = thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    client.post(Api::Chat.path(), &body)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("request thread")).collect()
    });
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    let (busy, served): (Vec<&Reply>, Vec<&Reply>) = replies.iter().partition(|r| r.status == 503);
    assert!(!busy.is_empty(), "one running and one queued leave no room for six: {statuses:?}");
    assert!(!served.is_empty(), "{statuses:?}");
    for reply in busy {
        let error = reply.error(503, "full queue");
        assert_eq!(error["type"], "server_error", "{error}");
        let retry_after = reply.retry_after.as_deref().unwrap_or_else(|| panic!("503 without Retry-After: {error}"));
        assert!(retry_after.parse::<u64>().is_ok_and(|secs| secs >= 1), "Retry-After {retry_after:?}");
    }
    for reply in served {
        let whole = Whole::of(Api::Chat, reply.ok("an accepted request"));
        assert_eq!((whole.finish_reason.as_str(), whole.usage.completion), ("length", 200), "{}", whole.json);
    }
    client.assert_healthy("a full queue");
    wait_for_metrics(&server, "an idle engine after the burst", idle);
}

#[test]
fn sigterm_finishes_in_flight_streams_and_exits_cleanly() {
    let mut server = Server::start(&["--shutdown-timeout", "30"]);
    let body = chat(
        "Describe the sea.",
        json!({"stream": true, "max_tokens": 48, "ignore_eos": true, "stream_options": {"include_usage": true}}),
    );
    let mut stream = server.client().stream(Api::Chat.path(), &body);
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.next_chunk() {
        let has_text = chunk["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty());
        chunks.push(chunk);
        if has_text {
            break;
        }
    }
    server.terminate();
    chunks.extend(stream.rest());
    let streamed = Streamed::of(Api::Chat, &chunks);
    assert_eq!(
        streamed.finish_reason,
        "length",
        "the in-flight stream was cut: {streamed:?}\n{}",
        server.logs().tail()
    );
    assert_eq!(streamed.usage.map(|u| u.completion), Some(48));
    let status = server
        .wait_exit(EXIT_DEADLINE)
        .unwrap_or_else(|| panic!("still running {EXIT_DEADLINE:?} after SIGTERM\n{}", server.logs().tail()));
    assert!(status.success(), "exit {status}\n{}", server.logs().tail());
}

#[test]
fn a_second_signal_during_the_grace_period_stops_at_once() {
    let mut server = Server::start(&["--shutdown-timeout", "120"]);
    // A stream far longer than the test waits: only the second signal can end the process in time.
    let body = chat("Describe the sea.", json!({"stream": true, "max_tokens": 900, "ignore_eos": true}));
    let mut stream = server.client().stream(Api::Chat.path(), &body);
    while let Some(chunk) = stream.next_chunk() {
        if chunk["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty()) {
            break;
        }
    }
    server.terminate();
    let waiting = server.wait_exit(Duration::from_millis(500));
    assert!(waiting.is_none(), "the first signal waits for the stream: {waiting:?}\n{}", server.logs().tail());
    assert!(server.logs().contains("shutting down"), "{}", server.logs().tail());
    server.terminate();
    let status = server
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("still running 5 s after a second SIGTERM\n{}", server.logs().tail()));
    assert_eq!(status.code(), Some(130), "{}", server.logs().tail());
    // Its last log line may still be on its way through the pipe.
    let said = (0..40).any(|_| {
        let found = server.logs().contains("second signal");
        if !found {
            thread::sleep(Duration::from_millis(50));
        }
        found
    });
    assert!(said, "{}", server.logs().tail());
}

#[test]
fn a_request_cut_by_the_end_of_the_grace_period_gets_503() {
    let mut server = Server::start(&["--shutdown-timeout", "1"]);
    // Far more tokens than one second of decoding on two cores.
    let body = chat("Describe the sea.", json!({"max_tokens": 900, "ignore_eos": true}));
    let reply = thread::scope(|s| {
        let request = s.spawn(|| server.client().post(Api::Chat.path(), &body));
        wait_for_metrics(&server, "the request running", |m| m.value("dflash_running_sequences", &[]) == 1.0);
        server.terminate();
        request.join().expect("request thread")
    });
    let error = reply.error(503, "a request cut by shutdown");
    assert_eq!(error["type"], "server_error", "{error}");
    let status = server
        .wait_exit(EXIT_DEADLINE)
        .unwrap_or_else(|| panic!("still running {EXIT_DEADLINE:?} after SIGTERM\n{}", server.logs().tail()));
    assert!(status.success(), "exit {status}\n{}", server.logs().tail());
}
