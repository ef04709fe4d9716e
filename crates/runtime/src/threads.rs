//! The CPU thread pool.
//!
//! Every multi-threaded CPU op runs on rayon's global pool; [`init`] sizes it once at start-up
//! (`--threads`). Ops split work into one chunk per thread (not per row) because at decode sizes the
//! dispatch cost of fine-grained tasks is comparable to the work.

use std::sync::OnceLock;

static THREADS: OnceLock<usize> = OnceLock::new();

/// Runs `f` on a worker of the global pool, so the ops it calls dispatch their parallel chunks from inside the
/// pool. A parallel call made from a thread outside the pool pays a cross-thread injection (measured 11-26 us
/// per call here); from inside it costs 2-6 us. A forward makes about 120 such calls per token.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    // `rayon::scope` runs its closure on a pool worker when called from outside the pool.
    rayon::scope(|_| f())
}

/// Sizes the global pool. `None` uses the number of physical-ish cores rayon detects.
/// Later calls are ignored (the pool can be built only once per process).
pub fn init(threads: Option<usize>) -> usize {
    *THREADS.get_or_init(|| {
        let mut b = rayon::ThreadPoolBuilder::new();
        if let Some(n) = threads {
            b = b.num_threads(n.max(1));
        }
        // An error means a pool already exists (e.g. in tests); use it as it is.
        let _ = b.build_global();
        rayon::current_num_threads()
    })
}

/// Number of threads ops split work across.
pub fn count() -> usize {
    THREADS.get().copied().unwrap_or_else(rayon::current_num_threads)
}
