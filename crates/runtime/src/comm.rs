//! Collectives between the ranks of a tensor-parallel model: each rank holds a slice of every layer and the ranks
//! add their partial results together after the attention output and the MLP's down projection.
//!
//! [`Solo`] is one rank (tensor parallelism off: every collective is the identity). [`ThreadGroup`] joins ranks that
//! are threads of one process on the CPU; its all-reduce adds the ranks' values in rank order, so every rank gets the
//! same bits whatever the threads' timing. A device communicator (NCCL on CUDA) implements the same trait.

use std::sync::{Arc, Barrier, Mutex, PoisonError};

/// Errors of a collective.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank} sent {got} values to a collective where this rank sent {want}")]
    Length { rank: usize, got: usize, want: usize },
    #[error("a rank of the group panicked during a collective")]
    Poisoned,
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
}

/// What the ranks of a [`ThreadGroup`] share: each rank's contribution to the collective under way.
#[derive(Debug)]
struct Shared {
    slots: Vec<Mutex<Vec<f32>>>,
    barrier: Barrier,
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
        let shared = Arc::new(Shared {
            slots: (0..size).map(|_| Mutex::new(Vec::new())).collect(),
            barrier: Barrier::new(size),
        });
        (0..size).map(|rank| ThreadGroup { rank, shared: Arc::clone(&shared) }).collect()
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
        let poisoned = |_: PoisonError<_>| CommError::Poisoned;
        {
            let mut mine = self.shared.slots[self.rank].lock().map_err(poisoned)?;
            mine.clear();
            mine.extend_from_slice(data);
        }
        self.shared.barrier.wait();
        // Every rank adds the same operands in the same order (rank 0 first), so every rank gets the same bits.
        let mut result = Ok(());
        for (rank, slot) in self.shared.slots.iter().enumerate() {
            let theirs = slot.lock().map_err(poisoned)?;
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
        self.shared.barrier.wait();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_group_gives_every_rank_the_sum_in_rank_order() {
        let ranks = ThreadGroup::new(3);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|comm| {
                    s.spawn(move || {
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
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
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
        let errors: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|comm| s.spawn(move || comm.all_reduce_sum(&mut vec![0.0; 2 + comm.rank()]).is_err()))
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        assert_eq!(errors, vec![true, true]);
    }

    #[test]
    fn solo_is_the_identity() {
        let mut data = vec![1.5, -2.0];
        Solo.all_reduce_sum(&mut data).expect("solo");
        assert_eq!(data, vec![1.5, -2.0]);
        assert_eq!((Solo.rank(), Solo.size()), (0, 1));
    }
}
