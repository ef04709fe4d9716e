//! [`TensorParallelTarget`]: one model split over tensor-parallel ranks on the CPU, whatever its family.
//!
//! Each rank is a target of its own (the family's CPU target over the rank's share of the model, with the caches
//! and per-sequence state of its heads) and runs on a rayon pool of its own: a rank waiting in a collective holds
//! its worker, which in a shared pool another rank's op could need. The ranks meet in a [`ThreadGroup`] inside
//! every forward. Every forward runs on all ranks at once and every rank ends with the same logits, so rank 0's
//! output is the step's; per-sequence state (a hybrid model's recurrent layers) is kept, rolled back and
//! snapshotted on every rank.
//!
//! A rank that fails or panics gives up the group's collectives ([`ThreadGroup::abort`]) so the others return
//! instead of waiting for it; the step fails, and the group is reset for the next one.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use dflash_runtime::comm::{CommError, ThreadGroup};
use rayon::ThreadPool;

use crate::batch::{ForwardBatch, ForwardOut, Readout};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::target::{HostHeads, ResumeState, StepSeq, Target, TargetHeads};

/// A model split over tensor-parallel ranks on the CPU.
pub struct TensorParallelTarget {
    /// The whole model's config (each rank's holds its share of the heads and columns).
    config: ModelConfig,
    ranks: Vec<Box<dyn Target>>,
    /// The group the ranks' models meet in.
    group: Arc<ThreadGroup>,
    pools: Vec<ThreadPool>,
    heads: Arc<HostHeads>,
}

/// One rank's part of a call: the rank's index and its target.
type RankJob<'a, T> = dyn Fn(usize, &mut Box<dyn Target>) -> Result<T> + Sync + 'a;

impl TensorParallelTarget {
    /// Joins `ranks` (rank `r`'s target first to last, their models built over members of the group `group`
    /// belongs to), each run on a pool of `threads` threads. `config` is the whole model's, `heads` its whole
    /// embedding, LM head and final norm for drafters.
    ///
    /// # Errors
    /// No ranks; a thread pool that cannot be made.
    pub fn new(
        config: ModelConfig,
        ranks: Vec<Box<dyn Target>>,
        group: Arc<ThreadGroup>,
        heads: HostHeads,
        threads: usize,
    ) -> Result<Self> {
        if ranks.is_empty() {
            return Err(ModelError::Config("tensor parallelism over no ranks".into()));
        }
        let pools = (0..ranks.len())
            .map(|rank| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads.max(1))
                    .thread_name(move |i| format!("tp-rank{rank}-{i}"))
                    .build()
                    .map_err(|e| ModelError::Unsupported(format!("a thread pool for tensor-parallel rank {rank}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TensorParallelTarget { config, ranks, group, pools, heads: Arc::new(heads) })
    }

    /// Ranks the model is split over.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Runs `f` on every rank at once, each on its own pool, and returns rank 0's result, or the failure of the
    /// first rank that failed on its own (before the aborted collectives it caused elsewhere).
    fn on_every_rank<T: Send>(&mut self, f: &(dyn Fn(&mut dyn Target) -> Result<T> + Sync)) -> Result<T> {
        let group = &self.group;
        let job = |index: usize, rank: &mut Box<dyn Target>| {
            let out = catch_unwind(AssertUnwindSafe(|| f(rank.as_mut())))
                .unwrap_or_else(|_| Err(CommError::RankPanicked { rank: index }.into()));
            if out.is_err() {
                // The others may be waiting in a collective this rank will not reach.
                group.abort();
            }
            out
        };
        let mut results: Vec<Option<Result<T>>> = self.ranks.iter().map(|_| None).collect();
        spawn_ranks(&self.pools, &mut self.ranks, &mut results, 0, &job);
        let mut results = results.into_iter().map(|r| r.unwrap_or_else(|| Err(CommError::Aborted.into())));
        let lead = results.next().unwrap_or_else(|| Err(ModelError::Config("no tensor-parallel rank".into())));
        // An aborted collective is what another rank's failure left behind: report the failure itself.
        let mut failed = None;
        for err in results.filter_map(|r| r.err()) {
            if failed.is_none() || matches!(failed, Some(ModelError::Comm(CommError::Aborted))) {
                failed = Some(err);
            }
        }
        if lead.is_err() || failed.is_some() {
            // Every rank has returned, so none is inside a collective: the group can be used again.
            self.group.reset();
        }
        match (lead, failed) {
            (Ok(out), None) => Ok(out),
            (Err(ModelError::Comm(CommError::Aborted)), Some(e)) | (Ok(_), Some(e)) | (Err(e), _) => Err(e),
        }
    }

    /// Each rank's floats of a sequence's state snapshot, in rank order.
    fn snapshot_floats(&self) -> Vec<usize> {
        self.ranks
            .iter()
            .map(|r| match r.resume_state() {
                ResumeState::Snapshot { floats } => floats,
                ResumeState::Pages => 0,
            })
            .collect()
    }
}

/// Spawns rank `first`'s job on its pool, then the next rank's inside the same scope, so that every rank's job is
/// running before any scope waits for its own.
fn spawn_ranks<T: Send>(
    pools: &[ThreadPool],
    ranks: &mut [Box<dyn Target>],
    results: &mut [Option<Result<T>>],
    first: usize,
    job: &RankJob<'_, T>,
) {
    let (Some((pool, pools)), Some((rank, ranks)), Some((result, results))) =
        (pools.split_first(), ranks.split_first_mut(), results.split_first_mut())
    else {
        return;
    };
    pool.in_place_scope(|scope| {
        scope.spawn(move |_| *result = Some(job(first, rank)));
        spawn_ranks(pools, ranks, results, first + 1, job);
    });
}

impl Target for TensorParallelTarget {
    fn device(&self) -> String {
        format!("cpu, tensor parallel over {} ranks", self.ranks.len())
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn capture_layers(&self) -> &[usize] {
        self.ranks[0].capture_layers()
    }

    fn capture_width(&self) -> usize {
        self.ranks[0].capture_width()
    }

    fn stream_tap(&self) -> Option<crate::StreamTap> {
        self.ranks[0].stream_tap()
    }

    fn page_size(&self) -> usize {
        self.ranks[0].page_size()
    }

    fn num_pages(&self) -> usize {
        self.ranks[0].num_pages()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut> {
        self.on_every_rank(&|rank| rank.forward(batch))
    }

    fn forward_step(&mut self, batch: &ForwardBatch, seqs: &[StepSeq], readout: Readout) -> Result<ForwardOut> {
        self.on_every_rank(&|rank| rank.forward_step(batch, seqs, readout))
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        Some(Arc::clone(&self.heads) as Arc<dyn TargetHeads>)
    }

    fn verified(&mut self, key: u64, kept_rows: usize) {
        self.ranks.iter_mut().for_each(|r| r.verified(key, kept_rows));
    }

    fn release(&mut self, key: u64) {
        self.ranks.iter_mut().for_each(|r| r.release(key));
    }

    fn kv_layers(&self) -> usize {
        self.ranks[0].kv_layers()
    }

    fn resume_state(&self) -> ResumeState {
        match self.ranks[0].resume_state() {
            ResumeState::Pages => ResumeState::Pages,
            ResumeState::Snapshot { .. } => ResumeState::Snapshot { floats: self.snapshot_floats().iter().sum() },
        }
    }

    fn prompt_cut_alignment(&self) -> usize {
        self.ranks[0].prompt_cut_alignment()
    }

    fn graphs_captured(&self) -> usize {
        self.ranks.iter().map(|rank| rank.graphs_captured()).sum()
    }

    fn step_padding(&self) -> Option<crate::StepPadding> {
        // Every rank runs the same step shapes.
        self.ranks.first().and_then(|rank| rank.step_padding())
    }

    /// Every rank's snapshot, in rank order.
    fn snapshot_state(&self, key: u64) -> Option<Vec<f32>> {
        let mut all = Vec::new();
        for rank in &self.ranks {
            all.extend(rank.snapshot_state(key)?);
        }
        Some(all)
    }

    fn restore_state(&mut self, key: u64, snapshot: &[f32]) -> Result<()> {
        let floats = self.snapshot_floats();
        let want: usize = floats.iter().sum();
        if snapshot.len() != want {
            return Err(ModelError::State(format!(
                "a snapshot of {} floats for {} ranks that keep {want}",
                snapshot.len(),
                self.ranks.len()
            )));
        }
        let mut at = 0;
        for (rank, n) in self.ranks.iter_mut().zip(floats) {
            rank.restore_state(key, &snapshot[at..at + n])?;
            at += n;
        }
        Ok(())
    }
}
