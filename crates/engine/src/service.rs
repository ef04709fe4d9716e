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
    Submit(Request, Box<dyn EventSink>),
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
    max_queue: usize,
    metrics: Arc<EngineMetrics>,
}

impl EngineClient {
    /// Hands a request to the engine; its events go to `sink`.
    ///
    /// # Errors
    /// [`SubmitError::Busy`] when `max_queue` requests already wait for admission; [`SubmitError::ShuttingDown`]
    /// after [`EngineClient::shutdown`] or when the engine thread has stopped.
    pub fn submit(&self, request: Request, sink: Box<dyn EventSink>) -> Result<(), SubmitError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        let queued = self.in_flight.fetch_add(1, Ordering::AcqRel) + self.metrics.queue_depth();
        if queued >= self.max_queue {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::Busy);
        }
        match self.tx.try_send(Command::Submit(request, sink)) {
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
        // The channel has room for one command beyond `max_queue` submissions; a blocking send is fine here.
        let _ = self.tx.send(Command::Shutdown(grace));
    }

    pub fn metrics(&self) -> &Arc<EngineMetrics> {
        &self.metrics
    }
}

/// Starts the engine thread. The thread exits after a shutdown once no work is left (or its grace period ends),
/// or when every client is dropped and no work is left.
///
/// # Errors
/// When the thread cannot be spawned.
pub fn spawn(
    engine: Engine,
    max_queue: usize,
    metrics: Arc<EngineMetrics>,
) -> std::io::Result<(EngineClient, JoinHandle<()>)> {
    let max_queue = max_queue.max(1);
    let (tx, rx) = mpsc::sync_channel(max_queue + 1);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let client = EngineClient {
        tx,
        in_flight: Arc::clone(&in_flight),
        closed: Arc::new(AtomicBool::new(false)),
        max_queue,
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
            engine.add(request, sink);
        }
        Command::Shutdown(grace) => {
            let at = Instant::now() + grace;
            *deadline = Some(deadline.map_or(at, |d| d.min(at)));
        }
    }
}
