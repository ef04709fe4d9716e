//! Collectives between the ranks of a tensor-parallel model: each rank holds a slice of every layer and the ranks
//! add their partial results together after the attention output and the MLP's down projection.
//!
//! [`Solo`] is one rank (tensor parallelism off: every collective is the identity). [`ThreadGroup`] joins ranks that
//! are threads of one process on the CPU; its all-reduce adds the ranks' values in rank order, so every rank gets the
//! same bits whatever the threads' timing. A device communicator (NCCL on CUDA) implements the same trait.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

/// Errors of a collective.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank} sent {got} values to a collective where this rank sent {want}")]
    Length { rank: usize, got: usize, want: usize },
    #[error("a rank of the group panicked during a collective")]
    Poisoned,
    #[error("a rank of the group failed, so this collective was abandoned")]
    Aborted,
    #[error("rank {rank} panicked")]
    RankPanicked { rank: usize },
}

/// The collectives a tensor-parallel forward uses. Every rank of a group must call each collective, in the same
/// order, with buffers of the same length.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Replaces `data` on every rank by the element-wise sum of every rank's `data`.
    ///
    /// # Errors
    /// Ranks that passed different lengths; a rank that panicked.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError>;

    /// Sets `out` on every rank to every rank's `mine`, concatenated in rank order (ranks may send different
    /// lengths).
    ///
    /// # Errors
    /// A rank that panicked or failed.
    fn all_gather(&self, mine: &[f32], out: &mut Vec<f32>) -> Result<(), CommError>;
}

/// One rank: tensor parallelism off.
#[derive(Clone, Copy, Debug, Default)]
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&self, _data: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }

    fn all_gather(&self, mine: &[f32], out: &mut Vec<f32>) -> Result<(), CommError> {
        out.clear();
        out.extend_from_slice(mine);
        Ok(())
    }
}

/// What the ranks of a [`ThreadGroup`] share: each rank's contribution to the collective under way, and the
/// gate they meet at.
#[derive(Debug)]
struct Shared {
    slots: Vec<Mutex<Vec<f32>>>,
    gate: Gate,
}

/// A barrier that a failing rank can open for the others: [`Gate::abort`] makes every wait, present and
/// future, return [`CommError::Aborted`] until [`Gate::reset`]. (A std `Barrier` would leave the other ranks
/// waiting for ever on a rank that returned early or panicked.)
#[derive(Debug)]
struct Gate {
    size: usize,
    state: Mutex<GateState>,
    turn: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    waiting: usize,
    generation: u64,
    aborted: bool,
}

impl Gate {
    fn new(size: usize) -> Self {
        Gate { size, state: Mutex::new(GateState::default()), turn: Condvar::new() }
    }

    fn lock(&self) -> Result<MutexGuard<'_, GateState>, CommError> {
        self.state.lock().map_err(|_: PoisonError<_>| CommError::Poisoned)
    }

    /// Returns once every rank has arrived, or with `Aborted` once any rank gave up.
    fn wait(&self) -> Result<(), CommError> {
        let mut s = self.lock()?;
        if s.aborted {
            return Err(CommError::Aborted);
        }
        let generation = s.generation;
        s.waiting += 1;
        if s.waiting == self.size {
            s.waiting = 0;
            s.generation += 1;
            self.turn.notify_all();
            return Ok(());
        }
        while s.generation == generation && !s.aborted {
            s = self.turn.wait(s).map_err(|_: PoisonError<_>| CommError::Poisoned)?;
        }
        if s.generation == generation {
            return Err(CommError::Aborted);
        }
        Ok(())
    }

    fn abort(&self) {
        if let Ok(mut s) = self.lock() {
            s.aborted = true;
        }
        self.turn.notify_all();
    }

    fn reset(&self) {
        if let Ok(mut s) = self.lock() {
            *s = GateState { generation: s.generation + 1, ..GateState::default() };
        }
    }
}

/// A rank of a group of threads in one process. Each rank's thread must run its ops in a rayon pool of its own
/// (`ThreadPool::install`): a rank waiting in a collective holds its worker, and in a shared pool another rank's
/// parallel op could be waiting for that very worker.
#[derive(Debug)]
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// `size` ranks, one per thread that will run a shard: hand rank `r` to the thread of rank `r`.
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        let size = size.max(1);
        let shared =
            Arc::new(Shared { slots: (0..size).map(|_| Mutex::new(Vec::new())).collect(), gate: Gate::new(size) });
        (0..size).map(|rank| ThreadGroup { rank, shared: Arc::clone(&shared) }).collect()
    }

    /// Gives up the group's collectives: every rank waiting in one, and every later one, returns
    /// [`CommError::Aborted`]. A rank that fails outside a collective calls it so the others do not wait for it.
    pub fn abort(&self) {
        self.shared.gate.abort();
    }

    /// Makes an aborted group usable again. Only while no rank is inside a collective (between forwards).
    pub fn reset(&self) {
        self.shared.gate.reset();
    }

    /// Puts `data` in this rank's slot, for the others to read after the gate.
    fn publish(&self, data: &[f32]) -> Result<(), CommError> {
        let mut mine = self.shared.slots[self.rank].lock().map_err(|_| CommError::Poisoned)?;
        mine.clear();
        mine.extend_from_slice(data);
        Ok(())
    }
}

impl Communicator for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        self.publish(data)?;
        self.shared.gate.wait()?;
        // Every rank adds the same operands in the same order (rank 0 first), so every rank gets the same bits.
        let mut result = Ok(());
        for (rank, slot) in self.shared.slots.iter().enumerate() {
            let theirs = slot.lock().map_err(|_| CommError::Poisoned)?;
            if theirs.len() != data.len() {
                result = Err(CommError::Length { rank, got: theirs.len(), want: data.len() });
                break;
            }
            if rank == 0 {
                data.copy_from_slice(&theirs);
            } else {
                data.iter_mut().zip(theirs.iter()).for_each(|(d, t)| *d += t);
            }
        }
        // No rank may refill its slot for the next collective before every rank has read this one.
        self.shared.gate.wait()?;
        result
    }

    fn all_gather(&self, mine: &[f32], out: &mut Vec<f32>) -> Result<(), CommError> {
        self.publish(mine)?;
        self.shared.gate.wait()?;
        out.clear();
        for slot in &self.shared.slots {
            out.extend_from_slice(&slot.lock().map_err(|_| CommError::Poisoned)?);
        }
        self.shared.gate.wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `f` on every rank of `ranks`, each in a thread of its own: the results in rank order.
    fn on_ranks<T: Send>(ranks: &[ThreadGroup], f: impl Fn(&ThreadGroup) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks.iter().map(|comm| s.spawn(|| f(comm))).collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn a_thread_group_gives_every_rank_the_sum_in_rank_order() {
        let ranks = ThreadGroup::new(3);
        let results = on_ranks(&ranks, |comm| {
            // Values whose sum depends on the order: rank 0's 1e8, then +1 and -1e8 at rank 2.
            let mut data = match comm.rank() {
                0 => vec![1e8, 1.0, 0.5],
                1 => vec![1.0, 2.0, 0.25],
                _ => vec![-1e8, 3.0, 0.125],
            };
            comm.all_reduce_sum(&mut data).expect("all-reduce");
            // A second collective right after must not see the first one's values.
            let mut again = vec![comm.rank() as f32];
            comm.all_reduce_sum(&mut again).expect("second all-reduce");
            data.push(again[0]);
            data
        });
        let want = [(1e8f32 + 1.0) + -1e8, 6.0, 0.875, 3.0];
        for got in &results {
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        assert_eq!(results[0][0], 0.0, "rank order: (1e8 + 1) - 1e8 rounds the 1 away");
    }

    #[test]
    fn different_lengths_are_an_error_on_every_rank() {
        let ranks = ThreadGroup::new(2);
        let errors = on_ranks(&ranks, |comm| comm.all_reduce_sum(&mut vec![0.0; 2 + comm.rank()]).is_err());
        assert_eq!(errors, vec![true, true]);
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        let ranks = ThreadGroup::new(3);
        let results = on_ranks(&ranks, |comm| {
            let mine: Vec<f32> = (0..=comm.rank()).map(|i| (10 * comm.rank() + i) as f32).collect();
            let mut out = vec![-1.0; 7];
            comm.all_gather(&mine, &mut out).expect("all-gather");
            out
        });
        for got in &results {
            assert_eq!(got, &[0.0, 10.0, 11.0, 20.0, 21.0, 22.0]);
        }
    }

    #[test]
    fn an_aborted_group_releases_its_waiters_and_works_again_after_a_reset() {
        let ranks = ThreadGroup::new(2);
        let waited = std::thread::scope(|s| {
            // Rank 1 waits in a collective that rank 0 never joins: rank 0 gives up instead.
            let waiter = s.spawn(|| ranks[1].all_reduce_sum(&mut [1.0]));
            std::thread::sleep(std::time::Duration::from_millis(20));
            ranks[0].abort();
            waiter.join().expect("rank thread")
        });
        assert!(matches!(waited, Err(CommError::Aborted)), "{waited:?}");
        assert!(matches!(ranks[1].all_reduce_sum(&mut [1.0]), Err(CommError::Aborted)), "stays aborted");
        ranks[0].reset();
        let sums = on_ranks(&ranks, |comm| {
            let mut data = [comm.rank() as f32 + 1.0];
            comm.all_reduce_sum(&mut data).expect("after the reset");
            data[0]
        });
        assert_eq!(sums, vec![3.0, 3.0]);
    }

    #[test]
    fn solo_is_the_identity() {
        let mut data = vec![1.5, -2.0];
        Solo.all_reduce_sum(&mut data).expect("solo");
        assert_eq!(data, vec![1.5, -2.0]);
        assert_eq!((Solo.rank(), Solo.size()), (0, 1));
        let mut out = vec![9.0];
        Solo.all_gather(&[1.0, 2.0], &mut out).expect("solo");
        assert_eq!(out, vec![1.0, 2.0]);
    }
}
