//! The engine on its own thread, fed through a bounded channel; [`EngineClient`] is the handle request handlers
//! hold.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::engine::Engine;
use crate::metrics::EngineMetrics;
use crate::request::{EventSink, Request};

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The queue is full; retry later.
    #[error("the server is busy, please retry later")]
    Busy,
    /// The engine is stopping and takes no new work.
    #[error("the server is shutting down")]
    ShuttingDown,
}

enum Command {
    /// Boxed: a request is far larger than a shutdown, and the queue holds up to `--max-queue` commands.
    Submit(Box<Request>, Box<dyn EventSink>),
    /// Stop taking work; finish what runs within the grace period, then fail the rest.
    Shutdown(Duration),
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineClient {
    tx: SyncSender<Command>,
    /// Requests submitted but not yet taken in by the engine thread.
    in_flight: Arc<AtomicUsize>,
    closed: Arc<AtomicBool>,
    /// Requests the server holds at most: the engine's running sequences plus the queue.
    capacity: usize,
    metrics: Arc<EngineMetrics>,
}

impl EngineClient {
    /// Hands a request to the engine; its events go to `sink`.
    ///
    /// # Errors
    /// [`SubmitError::Busy`] when the engine runs as many sequences as it may and `max_queue` more requests
    /// wait (a burst is not refused while running slots are free, however slowly prompts are admitted);
    /// [`SubmitError::ShuttingDown`] after [`EngineClient::shutdown`] or when the engine thread has stopped.
    pub fn submit(&self, request: Request, sink: Box<dyn EventSink>) -> Result<(), SubmitError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        let held = self.in_flight.fetch_add(1, Ordering::AcqRel) + self.metrics.queue_depth() + self.metrics.running();
        if held >= self.capacity {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::Busy);
        }
        match self.tx.try_send(Command::Submit(Box::new(request), sink)) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Busy,
                    TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
                })
            }
        }
    }

    /// Stops accepting requests; running ones may finish within `grace`, after which they fail.
    pub fn shutdown(&self, grace: Duration) {
        self.closed.store(true, Ordering::Release);
        // The channel has room for one command beyond a full server's submissions; a blocking send is fine here.
        let _ = self.tx.send(Command::Shutdown(grace));
    }

    pub fn metrics(&self) -> &Arc<EngineMetrics> {
        &self.metrics
    }
}

/// Starts the engine thread; beyond the sequences the engine may run at once, `max_queue` requests may wait. The
/// thread exits after a shutdown once no work is left (or its grace period ends), or when every client is dropped
/// and no work is left.
///
/// # Errors
/// When the thread cannot be spawned.
pub fn spawn(
    engine: Engine,
    max_queue: usize,
    metrics: Arc<EngineMetrics>,
) -> std::io::Result<(EngineClient, JoinHandle<()>)> {
    let capacity = engine.max_running() + max_queue.max(1);
    let (tx, rx) = mpsc::sync_channel(capacity + 1);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let client = EngineClient {
        tx,
        in_flight: Arc::clone(&in_flight),
        closed: Arc::new(AtomicBool::new(false)),
        capacity,
        metrics,
    };
    let handle = std::thread::Builder::new().name("engine".into()).spawn(move || run(engine, &rx, &in_flight))?;
    Ok((client, handle))
}

/// The engine loop: take in commands, step while there is work, sleep on the channel when there is none.
fn run(mut engine: Engine, rx: &Receiver<Command>, in_flight: &AtomicUsize) {
    let mut deadline: Option<Instant> = None;
    loop {
        let mut disconnected = false;
        if !engine.has_work() {
            if deadline.is_some() {
                break;
            }
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(cmd) => take(&mut engine, cmd, in_flight, &mut deadline),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => take(&mut engine, cmd, in_flight, &mut deadline),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            engine.abort_all("the server is shutting down");
            break;
        }
        if let Err(e) = engine.step() {
            tracing::error!("engine step failed: {e}");
        }
        if disconnected && !engine.has_work() {
            break;
        }
    }
    // What the round policy learnt of this target, for the operator (the same table /metrics exports).
    tracing::info!("engine stopped; {}", engine.round_costs().summary());
}

fn take(engine: &mut Engine, cmd: Command, in_flight: &AtomicUsize, deadline: &mut Option<Instant>) {
    match cmd {
        Command::Submit(request, sink) => {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            engine.add(*request, sink);
        }
        Command::Shutdown(grace) => {
            let at = Instant::now() + grace;
            *deadline = Some(deadline.map_or(at, |d| d.min(at)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Gauges;

    fn request() -> Request {
        Request { ignore_eos: false, ..Request::for_test("r", vec![1, 2, 3], 4) }
    }

    /// A client of a server that runs up to `max_running` sequences and queues `max_queue` more, whose engine
    /// reports `running` and `waiting` and takes in nothing meanwhile.
    fn client(
        max_running: usize,
        max_queue: usize,
        running: usize,
        waiting: usize,
    ) -> (EngineClient, Receiver<Command>) {
        let capacity = max_running + max_queue;
        let (tx, rx) = mpsc::sync_channel(capacity + 1);
        let metrics = Arc::new(EngineMetrics::default());
        metrics.publish(Gauges { queue_depth: waiting, running, ..Gauges::default() });
        let client = EngineClient {
            tx,
            in_flight: Arc::new(AtomicUsize::new(0)),
            closed: Arc::new(AtomicBool::new(false)),
            capacity,
            metrics,
        };
        (client, rx)
    }

    /// How many of `n` submissions are accepted before the first refusal, which must be `Busy`.
    fn accepted(client: &EngineClient, n: usize) -> usize {
        for i in 0..n {
            match client.submit(request(), Box::new(crate::request::NullSink)) {
                Ok(()) => {}
                Err(e) => {
                    assert_eq!(e, SubmitError::Busy);
                    return i;
                }
            }
        }
        n
    }

    #[test]
    fn a_burst_fills_the_running_slots_and_the_queue_before_any_refusal() {
        // 256 sequences may run and 64 wait: a burst of 400 at an idle server is refused from the 321st on.
        let (idle, _rx) = client(256, 64, 0, 0);
        assert_eq!(accepted(&idle, 400), 320);
        // A server running 200 sequences with 10 waiting has room for 110 more.
        let (busy, _rx) = client(256, 64, 200, 10);
        assert_eq!(accepted(&busy, 400), 110);
    }

    #[test]
    fn a_full_server_refuses_until_the_engine_takes_work_in() {
        let (full, rx) = client(2, 1, 2, 1);
        assert_eq!(accepted(&full, 1), 0);
        // Nothing in flight, but the gauges still say full; once they drop, submissions pass again.
        full.metrics.publish(Gauges { queue_depth: 0, running: 1, ..Gauges::default() });
        assert_eq!(accepted(&full, 5), 2);
        drop(rx);
        full.metrics.publish(Gauges::default());
        assert_eq!(full.submit(request(), Box::new(crate::request::NullSink)), Err(SubmitError::ShuttingDown));
    }
}
