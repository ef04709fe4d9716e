//! A `dflash serve` child process on an ephemeral port: started, watched, logged and stopped.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::client::Client;

/// How long a server may take to load the model and start listening.
const STARTUP_DEADLINE: Duration = Duration::from_secs(180);
/// Lines of server log shown in failure messages.
const LOG_TAIL_LINES: usize = 60;
/// Flags every test server gets: a small KV cache (several servers may run at once on a small CI machine).
const BASE_ARGS: [&str; 9] =
    ["serve", "--host", "127.0.0.1", "--port", "0", "--threads", "2", "--kv-cache-mem", "128M"];
/// The context window of servers whose test does not choose one.
const DEFAULT_CTX: [&str; 2] = ["--ctx-size", "1024"];
/// What the server logs once its socket is bound.
const LISTENING_MARKER: &str = "listening on http://";

/// The server's stderr lines, shared with the thread that drains them.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<String>>>);

impl Logs {
    fn push(&self, line: String) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(line);
    }

    /// Whether some line contains `needle`.
    pub fn contains(&self, needle: &str) -> bool {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|l| l.contains(needle))
    }

    /// The last lines, for failure messages.
    pub fn tail(&self) -> String {
        let lines = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let start = lines.len().saturating_sub(LOG_TAIL_LINES);
        format!("--- server log (last {} lines) ---\n{}", lines.len() - start, lines[start..].join("\n"))
    }
}

/// A running `dflash serve`; killed on drop.
pub struct Server {
    child: Child,
    /// Kills the server if this test process dies without dropping it (a shared server lives in a static, and
    /// statics are never dropped): it waits for EOF on a pipe only this process holds open.
    watchdog: Child,
    logs: Logs,
    client: Client,
}

impl Server {
    /// Starts `dflash serve` on a free port with [`BASE_ARGS`] plus `extra_args` (and a 1024-token context unless
    /// they set one) and waits until it listens.
    pub fn start(extra_args: &[&str]) -> Server {
        let default_ctx = (!extra_args.contains(&"--ctx-size")).then_some(DEFAULT_CTX);
        let mut child = Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(BASE_ARGS)
            .args(default_ctx.into_iter().flatten())
            .args(extra_args)
            .env("DFLASH_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dflash serve");
        let mut watchdog = spawn_watchdog(child.id());
        let logs = Logs::default();
        let (port_tx, port_rx) = mpsc::channel();
        let stderr = child.stderr.take().expect("piped stderr");
        let drain_logs = logs.clone();
        thread::spawn(move || drain_stderr(stderr, &drain_logs, port_tx));
        let port = match port_rx.recv_timeout(STARTUP_DEADLINE) {
            Ok(port) => port,
            Err(error) => {
                let exit = abandon(&mut child, &mut watchdog);
                let why = match error {
                    RecvTimeoutError::Timeout => format!("did not listen within {STARTUP_DEADLINE:?}"),
                    RecvTimeoutError::Disconnected => "closed stderr before listening".to_string(),
                };
                panic!("dflash serve {extra_args:?} {why} (exit: {exit:?})\n{}", logs.tail())
            }
        };
        Server { child, watchdog, client: Client::new(port, logs.clone()), logs }
    }

    /// The HTTP client bound to this server.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The server's stderr so far.
    pub fn logs(&self) -> &Logs {
        &self.logs
    }

    /// Sends SIGTERM (graceful shutdown).
    pub fn terminate(&self) {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("run kill");
        assert!(status.success(), "kill -TERM {} failed: {status}", self.child.id());
    }

    /// Waits for the process to exit, polling until `deadline` has passed; `None` if it is still running.
    pub fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + deadline;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the server process") {
                return Some(status);
            }
            if Instant::now() >= until {
                return None;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The watchdog goes first, so it can never signal a pid the system has already reused.
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Stops a server that never came up; its exit status if it had already exited.
fn abandon(child: &mut Child, watchdog: &mut Child) -> Option<ExitStatus> {
    let _ = watchdog.kill();
    let _ = watchdog.wait();
    let exited = child.try_wait().ok().flatten();
    let _ = child.kill();
    let _ = child.wait();
    exited
}

fn spawn_watchdog(pid: u32) -> Child {
    Command::new("sh")
        .args(["-c", &format!("cat >/dev/null; kill -9 {pid} 2>/dev/null")])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the watchdog shell")
}

/// Keeps reading stderr so the server never blocks on a full pipe; reports the port once it is logged.
fn drain_stderr(stderr: ChildStderr, logs: &Logs, port_tx: Sender<u16>) {
    let mut reader = BufReader::new(stderr);
    let mut port_tx = Some(port_tx);
    let mut raw = Vec::new();
    loop {
        raw.clear();
        match reader.by_ref().read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let line = strip_ansi(String::from_utf8_lossy(&raw).trim_end());
        if let Some(port) = listening_port(&line) {
            if let Some(tx) = port_tx.take() {
                let _ = tx.send(port);
            }
        }
        logs.push(line);
    }
}

/// The port in a `listening on http://HOST:PORT` line.
pub fn listening_port(line: &str) -> Option<u16> {
    let start = line.find(LISTENING_MARKER)? + LISTENING_MARKER.len();
    let address = line[start..].split(|c: char| c.is_whitespace() || c == '/').next()?;
    let (_, port) = address.rsplit_once(':')?;
    let digits: String = port.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Drops terminal colour sequences (`ESC [ ... letter`), in case the logger colours its output anyway.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for next in chars.by_ref() {
                if next.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_is_parsed_from_the_listening_line() {
        let line = "2026-01-01T00:00:00Z  INFO listening on http://127.0.0.1:40123 (16 concurrent)";
        assert_eq!(listening_port(line), Some(40123));
        assert_eq!(listening_port("INFO listening on http://127.0.0.1:8000/"), Some(8000));
        assert_eq!(listening_port("INFO loaded model"), None);
    }

    #[test]
    fn colour_sequences_are_stripped() {
        assert_eq!(strip_ansi("\u{1b}[32m INFO\u{1b}[0m listening"), " INFO listening");
    }
}
