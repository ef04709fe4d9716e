//! Block passes and context appends replayed as CUDA graphs. A pass is about forty small launches (the default model's drafter:
//! 0.66 ms a call launched from the host, entry 81, for well under half of that on the GPU), so a pass whose launches
//! were seen before replays them in one call. What a pass's launches take as arguments (rows, the offsets of its
//! integer inputs, the attention's tiles, page-table stride and key splits, the readback) is its [`PassKey`];
//! everything else a pass varies (embedded rows, positions, slots, tables, key counts) is uploaded before the
//! replay to the addresses the graph reads.
//!
//! A graph holds the addresses of the workspace and of the context pages, so growing either drops every graph.
//! A key is captured the second time it is seen (one-off shapes of a busy server stay eager), and at most
//! [`MAX_GRAPHS`] are kept. `DFLASH_DRAFT_GRAPH=0` keeps every pass eager.

use std::collections::HashMap;

use dflash_runtime::cuda::{CudaDevice, CudaError, StepGraph};

use crate::error::Result;
use crate::target::device_err;

/// Graphs kept per drafter; a full cache is emptied before the next capture.
const MAX_GRAPHS: usize = 256;
/// Keys counted before the counts start over (a bound on the map, not a policy).
const MAX_SEEN: usize = 4096;

/// What a pass's launches are recorded with, beyond the addresses of the buffers they read.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct PassKey {
    /// A context append (its launches depend on `rows` alone), not a block pass.
    pub append: bool,
    pub rows: usize,
    pub sequences: usize,
    pub tiles: usize,
    pub max_tile_rows: usize,
    pub table_stride: usize,
    pub split_keys: usize,
    pub splits: usize,
    /// The summary's columns per slot; `None`: the logits stay dense.
    pub top_k: Option<usize>,
}

impl PassKey {
    /// The key of a context append of `rows` rows.
    pub(super) fn append(rows: usize) -> Self {
        PassKey {
            append: true,
            rows,
            sequences: 0,
            tiles: 0,
            max_tile_rows: 0,
            table_stride: 0,
            split_keys: 0,
            splits: 0,
            top_k: None,
        }
    }
}

/// The buffers graphs were captured over: the workspace's allocation count and the page pool's pages.
pub(super) type Buffers = (u64, usize);

/// One drafter's captured passes.
#[derive(Debug, Default)]
pub(super) struct PassGraphs {
    graphs: HashMap<PassKey, StepGraph>,
    seen: HashMap<PassKey, u32>,
    over: Buffers,
    /// Set when a capture failed: this drafter's passes stay eager.
    failed: bool,
    /// Graphs captured so far, ever (the held ones drop when buffers move; this only grows).
    captures: usize,
}

impl PassGraphs {
    /// Runs a pass of `key`: the replay of its graph, or `record`'s launches queued eagerly (and captured into a
    /// graph, then replayed, the second time `key` is seen over the same `buffers`).
    ///
    /// # Errors
    /// What `record` returns, or the driver refusing a replay.
    pub(super) fn run(
        &mut self,
        dev: &CudaDevice,
        key: PassKey,
        buffers: Buffers,
        record: impl Fn() -> Result<()>,
    ) -> Result<()> {
        if self.failed || dflash_runtime::switches::switches().no_draft_graph || dev.timeline_on() {
            return record();
        }
        if self.over != buffers {
            self.graphs.clear();
            self.seen.clear();
            self.over = buffers;
        }
        if let Some(graph) = self.graphs.get(&key) {
            return graph.launch().map_err(device_err);
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        let seen = self.seen.entry(key).or_insert(0);
        *seen += 1;
        if *seen < 2 {
            return record();
        }
        if self.graphs.len() >= MAX_GRAPHS {
            self.graphs.clear();
        }
        // A pass's own error (a shape it refuses) is returned as it is; only a failure of the capture itself turns
        // graphs off.
        let mut refused = None;
        let captured = dev.capture(|| {
            record().map_err(|e| {
                refused = Some(e);
                CudaError::Shape("a drafter pass refused while recorded".into())
            })
        });
        if let Some(e) = refused {
            return Err(e);
        }
        match captured {
            Ok(graph) => {
                graph.launch().map_err(device_err)?;
                self.graphs.insert(key, graph);
                self.captures += 1;
                tracing::debug!("drafter pass graph captured for {key:?} ({} held)", self.graphs.len());
                Ok(())
            }
            Err(e) => {
                tracing::warn!("a drafter pass could not be captured as a CUDA graph ({e}); its passes stay eager");
                self.failed = true;
                record()
            }
        }
    }

    /// Graphs held (for tests and logs).
    pub(super) fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Graphs captured so far, ever: a pass that raised it captured one.
    pub(super) fn captures(&self) -> usize {
        self.captures
    }
}
