//! Feed-forward blocks: the dense SwiGLU MLP and the sparse mixture of experts (HF `Qwen3MoeSparseMoeBlock`,
//! `Qwen3NextSparseMoeBlock`).
//!
//! Routing: `p = softmax(x · Wᵣᵀ)` in f32, the `top_k` largest (ties to the lower expert id), renormalised to sum
//! to one when `norm_topk_prob`. Each routed expert runs on the rows routed to it only, and a row's expert
//! outputs are added in ascending expert order (`out = Σₑ pₑ · expertₑ(x)`), as HF's expert loop does, so a
//! row's result does not depend on the other rows. Qwen3-Next adds the shared expert:
//! `out += sigmoid(x · w_gate) · shared(x)`, its gate riding along as one more router row.

use dflash_runtime::ops;
use dflash_runtime::{DType, Tensor};

use crate::error::Result;
use crate::weights::WeightStore;

use super::config::MoeDims;
use super::rows::{gather_rows, linear, RowPlan};
use super::weights::concat_rows;

/// `down(silu(gate(x)) · up(x))`.
#[derive(Debug)]
pub(crate) struct Mlp {
    pub(crate) gate_up: Tensor, // [2·inter, hidden]
    pub(crate) down: Tensor,    // [hidden, inter]
}

impl Mlp {
    /// Takes `{prefix}.gate_proj`, `up_proj`, `down_proj`.
    pub(crate) fn load(store: &mut WeightStore, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        let gate = store.take(&format!("{prefix}.gate_proj.weight"), &[inter, hidden])?;
        let up = store.take(&format!("{prefix}.up_proj.weight"), &[inter, hidden])?;
        Ok(Mlp {
            gate_up: concat_rows(&[&gate, &up])?,
            down: store.take(&format!("{prefix}.down_proj.weight"), &[hidden, inter])?,
        })
    }

    /// `x`: `[T, hidden]`; `out`: `[T, hidden]`, overwritten.
    pub(crate) fn forward(&self, plan: &RowPlan, x: &Tensor, out: &mut Tensor) -> Result<()> {
        let t = x.rows();
        let mut gate_up = Tensor::zeros(DType::F32, &[t, self.gate_up.rows()])?;
        linear(plan, x, &self.gate_up, &mut gate_up)?;
        let mut act = Tensor::zeros(DType::F32, &[t, self.down.row_len()])?;
        ops::swiglu_fused(&gate_up, &mut act)?;
        linear(plan, &act, &self.down, out)
    }
}

/// A sparse MoE block.
#[derive(Debug)]
pub(crate) struct SparseMoe {
    /// Router rows, then the shared expert's gate row when there is one.
    pub(crate) router: Tensor, // [experts (+ 1), hidden]
    pub(crate) experts: Vec<Mlp>,
    pub(crate) shared: Option<Mlp>,
    pub(crate) dims: MoeDims,
}

impl SparseMoe {
    /// Takes `{prefix}.gate`, `{prefix}.experts.*` and, with a shared expert, `{prefix}.shared_expert*`.
    pub(crate) fn load(store: &mut WeightStore, prefix: &str, dims: MoeDims, hidden: usize) -> Result<Self> {
        let p = |s: &str| format!("{prefix}.{s}");
        let gate = store.take(&p("gate.weight"), &[dims.num_experts, hidden])?;
        let experts = (0..dims.num_experts)
            .map(|e| Mlp::load(store, &p(&format!("experts.{e}")), hidden, dims.expert_intermediate))
            .collect::<Result<Vec<_>>>()?;
        let (router, shared) = match dims.shared_intermediate {
            Some(inter) => {
                let shared_gate = store.take(&p("shared_expert_gate.weight"), &[1, hidden])?;
                let shared = Mlp::load(store, &p("shared_expert"), hidden, inter)?;
                (concat_rows(&[&gate, &shared_gate])?, Some(shared))
            }
            None => (gate, None),
        };
        Ok(SparseMoe { router, experts, shared, dims })
    }

    /// `x`: `[T, hidden]`; `out`: `[T, hidden]`, overwritten.
    pub(crate) fn forward(&self, plan: &RowPlan, x: &Tensor, out: &mut Tensor) -> Result<()> {
        let (t, hidden) = (x.rows(), x.row_len());
        let mut logits = Tensor::zeros(DType::F32, &[t, self.router.rows()])?;
        linear(plan, x, &self.router, &mut logits)?;
        let routes = self.route(&logits)?;
        let dst = out.as_f32_mut()?;
        dst.fill(0.0);
        for (e, expert) in self.experts.iter().enumerate() {
            let picked: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(r, row)| row.iter().find(|(id, _)| *id == e).map(|&(_, w)| (r, w)))
                .collect();
            if picked.is_empty() {
                continue;
            }
            let rows: Vec<usize> = picked.iter().map(|&(r, _)| r).collect();
            let xs = gather_rows(x, &rows)?;
            let mut ys = Tensor::zeros(DType::F32, &[rows.len(), hidden])?;
            expert.forward(&plan.subset(&rows), &xs, &mut ys)?;
            for (y, &(r, w)) in ys.as_f32()?.chunks_exact(hidden).zip(&picked) {
                for (o, &v) in dst[r * hidden..(r + 1) * hidden].iter_mut().zip(y) {
                    *o += v * w;
                }
            }
        }
        if let Some(shared) = &self.shared {
            let mut ys = Tensor::zeros(DType::F32, &[t, hidden])?;
            shared.forward(plan, x, &mut ys)?;
            let gate_col = self.dims.num_experts;
            let lg = logits.as_f32()?;
            let width = logits.row_len();
            for (r, y) in ys.as_f32()?.chunks_exact(hidden).enumerate() {
                let g = 1.0 / (1.0 + (-lg[r * width + gate_col]).exp());
                for (o, &v) in dst[r * hidden..(r + 1) * hidden].iter_mut().zip(y) {
                    *o += g * v;
                }
            }
        }
        Ok(())
    }

    /// Each row's `(expert, weight)` picks.
    fn route(&self, logits: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let e = self.dims.num_experts;
        let width = logits.row_len();
        logits
            .as_f32()?
            .chunks_exact(width)
            .map(|row| {
                let mut probs = row[..e].to_vec();
                ops::softmax_in_place(&mut probs);
                let top = ops::top_k(&probs, self.dims.top_k);
                let sum: f32 = top.iter().map(|&(_, p)| p).sum();
                let norm = if self.dims.norm_topk_prob { sum } else { 1.0 };
                Ok(top.iter().map(|&(id, p)| (id as usize, p / norm)).collect())
            })
            .collect()
    }

    /// Bytes of the router, the shared expert and `top_k` routed experts: what one row reads per layer.
    pub(crate) fn active_bytes(&self) -> usize {
        let mlp = |m: &Mlp| m.gate_up.byte_len() + m.down.byte_len();
        let expert = self.experts.first().map(mlp).unwrap_or(0);
        self.router.byte_len() + self.shared.as_ref().map(mlp).unwrap_or(0) + self.dims.top_k * expert
    }
}

/// A layer's feed-forward block.
#[derive(Debug)]
pub(crate) enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl Ffn {
    pub(crate) fn forward(&self, plan: &RowPlan, x: &Tensor, out: &mut Tensor) -> Result<()> {
        match self {
            Ffn::Dense(m) => m.forward(plan, x, out),
            Ffn::Sparse(m) => m.forward(plan, x, out),
        }
    }

    pub(crate) fn active_bytes(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.gate_up.byte_len() + m.down.byte_len(),
            Ffn::Sparse(m) => m.active_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(norm_topk_prob: bool) -> SparseMoe {
        let dims =
            MoeDims { num_experts: 3, top_k: 2, expert_intermediate: 1, shared_intermediate: None, norm_topk_prob };
        let one = |v: f32| Tensor::from_f32(&[v, v], &[1, 2]).expect("w");
        // Expert e: gate = up = e + 1, down = 1: y = silu(s x) · s x for x = (1, 0).
        let experts = (0..3)
            .map(|e| Mlp {
                gate_up: concat_rows(&[&one(e as f32 + 1.0), &one(e as f32 + 1.0)]).expect("gu"),
                down: Tensor::from_f32(&[1.0, 1.0], &[2, 1]).expect("down"),
            })
            .collect();
        let router = Tensor::from_f32(&[0.0, 0.0, 2.0, 0.0, 1.0, 0.0], &[3, 2]).expect("router");
        SparseMoe { router, experts, shared: None, dims }
    }

    #[test]
    fn routes_top_k_and_renormalises_on_request() {
        let x = Tensor::from_f32(&[1.0, 0.0], &[1, 2]).expect("x");
        let plan = RowPlan::from_batch(&crate::batch::ForwardBatch {
            tokens: &[0],
            positions: &[0],
            seqs: &[crate::batch::SeqRows { num_rows: 1, context_len: 0, block_table: &[0], prompt_len: 1 }],
            slots: &[0],
            logit_rows: &[],
        });
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let expert = |s: f32| silu(s) * s;
        let logits = [0.0f32, 2.0, 1.0];
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        let (p1, p2) = (2f32.exp() / z, 1f32.exp() / z);
        for norm in [false, true] {
            let m = moe(norm);
            let mut out = Tensor::zeros(DType::F32, &[1, 2]).expect("out");
            m.forward(&plan, &x, &mut out).expect("forward");
            let (w1, w2) = if norm { (p1 / (p1 + p2), p2 / (p1 + p2)) } else { (p1, p2) };
            // Experts 1 (p1) and 2 (p2) win; expert 0 is not evaluated.
            let want = w1 * expert(2.0) + w2 * expert(3.0);
            let got = out.as_f32().expect("f32")[0];
            assert!((got - want).abs() < 1e-5, "norm {norm}: {got} vs {want}");
        }
    }
}
