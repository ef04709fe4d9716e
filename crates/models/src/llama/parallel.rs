//! [`TensorParallelTarget`]: a Llama-family model split over tensor-parallel ranks on the CPU.
//!
//! Each rank holds its share of every layer ([`crate::shard::Shard`]: its heads, KV heads, MLP columns and LM-head
//! rows) and a KV cache of its own KV heads, and runs on a rayon pool of its own: a rank waiting in a collective
//! holds its worker, which in a shared pool another rank's op could need. The ranks meet in a [`ThreadGroup`]
//! after the attention output, the MLP's down projection and the LM head. Every forward runs on all ranks at once
//! and every rank ends with the same logits, so rank 0's output is the step's.
//!
//! A rank that fails or panics gives up the group's collectives ([`ThreadGroup::abort`]) so the others return
//! instead of waiting for it; the step fails, and the group is reset for the next one.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use dflash_runtime::comm::{CommError, Communicator, ThreadGroup};
use rayon::ThreadPool;

use crate::batch::{ForwardBatch, ForwardOut, KvCache};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::llama::LlamaModel;
use crate::target::{HostHeads, Target, TargetHeads};
use crate::weights::WeightStore;

/// One rank: its share of the model, its KV cache and its handle on the group.
struct Rank {
    model: LlamaModel,
    kv: KvCache,
    comm: Arc<ThreadGroup>,
}

/// A Llama-family model split over `size` tensor-parallel ranks on the CPU, with the caches of every rank.
pub struct TensorParallelTarget {
    /// The whole model's config (each rank's holds its share of the heads and MLP columns).
    config: ModelConfig,
    ranks: Vec<Rank>,
    pools: Vec<ThreadPool>,
    heads: Arc<HostHeads>,
}

impl TensorParallelTarget {
    /// Reads `cfg`'s weights from `store` once and splits them over `size` ranks, each with a pool of `threads`
    /// threads and a cache of `num_pages` pages of `page_size` tokens.
    ///
    /// # Errors
    /// As [`LlamaModel::load_ranks`]; a pool or cache that cannot be made.
    pub fn load(
        cfg: ModelConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
        size: usize,
        threads: usize,
        (num_pages, page_size): (usize, usize),
    ) -> Result<Self> {
        let group: Vec<Arc<ThreadGroup>> = ThreadGroup::new(size).into_iter().map(Arc::new).collect();
        let comms: Vec<Arc<dyn Communicator>> = group.iter().map(|g| Arc::clone(g) as Arc<dyn Communicator>).collect();
        let (models, heads) = LlamaModel::load_ranks(cfg.clone(), store, capture_layers, &comms)?;
        let mut ranks = Vec::with_capacity(size);
        let mut pools = Vec::with_capacity(size);
        for (rank, (model, comm)) in models.into_iter().zip(group).enumerate() {
            let kv = model.new_kv_cache(num_pages, page_size)?;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads.max(1))
                .thread_name(move |i| format!("tp-rank{rank}-{i}"))
                .build()
                .map_err(|e| ModelError::Unsupported(format!("a thread pool for tensor-parallel rank {rank}: {e}")))?;
            ranks.push(Rank { model, kv, comm });
            pools.push(pool);
        }
        Ok(TensorParallelTarget { config: cfg, ranks, pools, heads: Arc::new(heads) })
    }

    /// Ranks the model is split over.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Bytes of weights rank `rank` reads a step and bytes of its KV cache (for the start-up report).
    pub fn rank_bytes(&self, rank: usize) -> Option<(usize, usize)> {
        let r = self.ranks.get(rank)?;
        let kv = r.kv.k.iter().chain(&r.kv.v).map(|t| t.byte_len()).sum();
        Some((r.model.weight_bytes(), kv))
    }
}

/// Runs `f` on every rank at once, each on its own pool: the ranks' results in rank order.
fn on_every_rank<T: Send>(
    pools: &[ThreadPool],
    ranks: &mut [Rank],
    f: &(dyn Fn(usize, &mut Rank) -> T + Sync),
) -> Vec<T> {
    let mut results: Vec<Option<T>> = ranks.iter().map(|_| None).collect();
    spawn_ranks(pools, ranks, &mut results, 0, f);
    results.into_iter().flatten().collect()
}

/// Spawns rank `first`'s job on its pool, then the next rank's inside the same scope, so that every rank's job is
/// running before any scope waits for its own.
fn spawn_ranks<T: Send>(
    pools: &[ThreadPool],
    ranks: &mut [Rank],
    results: &mut [Option<T>],
    first: usize,
    f: &(dyn Fn(usize, &mut Rank) -> T + Sync),
) {
    let (Some((pool, pools)), Some((rank, ranks)), Some((result, results))) =
        (pools.split_first(), ranks.split_first_mut(), results.split_first_mut())
    else {
        return;
    };
    pool.in_place_scope(|scope| {
        scope.spawn(move |_| *result = Some(f(first, rank)));
        spawn_ranks(pools, ranks, results, first + 1, f);
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
        self.ranks[0].model.capture_layers()
    }

    fn capture_width(&self) -> usize {
        self.ranks[0].model.capture_width()
    }

    fn page_size(&self) -> usize {
        self.ranks[0].kv.page_size
    }

    fn num_pages(&self) -> usize {
        self.ranks[0].kv.num_pages
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOut> {
        let outs = on_every_rank(&self.pools, &mut self.ranks, &|index, rank: &mut Rank| {
            let out = catch_unwind(AssertUnwindSafe(|| rank.model.forward(batch, &mut rank.kv)))
                .unwrap_or_else(|_| Err(CommError::RankPanicked { rank: index }.into()));
            if out.is_err() {
                // The others may be waiting in a collective this rank will not reach.
                rank.comm.abort();
            }
            out
        });
        let mut outs = outs.into_iter();
        let lead = outs.next().unwrap_or_else(|| Err(ModelError::Config("no tensor-parallel rank".into())));
        let failed = outs.find_map(|o| o.err());
        if lead.is_err() || failed.is_some() {
            // Every rank has returned, so none is inside a collective: the group can be used again.
            self.ranks[0].comm.reset();
        }
        // A rank's own failure says more than the aborted collectives it caused elsewhere.
        match (lead, failed) {
            (Ok(out), None) => Ok(out),
            (Err(ModelError::Comm(CommError::Aborted)), Some(e)) | (Ok(_), Some(e)) | (Err(e), _) => Err(e),
        }
    }

    fn host_heads(&self) -> Option<Arc<dyn TargetHeads>> {
        Some(Arc::clone(&self.heads) as Arc<dyn TargetHeads>)
    }
}
