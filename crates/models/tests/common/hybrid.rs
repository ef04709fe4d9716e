//! Single-sequence forwards of the hybrid model over its own cache and recurrent state.

use dflash_models::hybrid::{HybridModel, HybridState};
use dflash_models::{ForwardBatch, KvCache, SeqRows};

use super::Golden;

pub const PAGE_SIZE: usize = 4;

/// One sequence's cache, state and length, fed through single-sequence forwards.
pub struct Seq {
    pub kv: KvCache,
    pub state: HybridState,
    pub table: Vec<u32>,
    pub len: usize,
    pub prompt_len: usize,
}

/// What one forward returned: every row's logits and captured taps.
pub struct Rows {
    pub logits: Vec<f32>,
    pub captured: Vec<f32>,
}

impl Seq {
    pub fn new(model: &HybridModel, capacity: usize, prompt_len: usize) -> Self {
        let pages = capacity.div_ceil(PAGE_SIZE);
        // A reversed, offset block table: attention must follow it.
        let table: Vec<u32> = (0..pages as u32).map(|p| pages as u32 + 1 - p).collect();
        let kv = model.new_kv_cache(pages + 2, PAGE_SIZE).expect("cache");
        Seq { kv, state: model.new_state(), table, len: 0, prompt_len }
    }

    pub fn forward(&mut self, model: &HybridModel, tokens: &[u32]) -> Rows {
        let n = tokens.len();
        let positions: Vec<u32> = (self.len..self.len + n).map(|p| p as u32).collect();
        let slots: Vec<u32> = (self.len..self.len + n)
            .map(|p| self.table[p / PAGE_SIZE] * PAGE_SIZE as u32 + (p % PAGE_SIZE) as u32)
            .collect();
        let rows: Vec<u32> = (0..n as u32).collect();
        let seqs =
            [SeqRows { num_rows: n, context_len: self.len, block_table: &self.table, prompt_len: self.prompt_len }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
        let out = model.forward(&batch, &mut self.kv, &mut [&mut self.state]).expect("forward");
        self.len += n;
        Rows {
            logits: out.logits.as_f32().expect("f32").to_vec(),
            captured: out.captured.map(|c| c.as_f32().expect("f32").to_vec()).unwrap_or_default(),
        }
    }

    /// Forwards `tokens` in pieces of `chunk` rows, concatenating what they return.
    pub fn feed(&mut self, model: &HybridModel, tokens: &[u32], chunk: usize) -> Rows {
        let mut all = Rows { logits: Vec::new(), captured: Vec::new() };
        for part in tokens.chunks(chunk) {
            let r = self.forward(model, part);
            all.logits.extend(r.logits);
            all.captured.extend(r.captured);
        }
        all
    }
}

/// Row `row` of a golden token tensor.
pub fn tokens_of(g: &Golden, row: usize) -> Vec<u32> {
    let len = g.shape[g.shape.len() - 1];
    g.data[row * len..(row + 1) * len].iter().map(|&x| x as u32).collect()
}
