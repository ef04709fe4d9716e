//! Feed-forward blocks: the dense SwiGLU MLP and the sparse mixture of experts (HF `Qwen3MoeSparseMoeBlock`,
//! `Qwen3NextSparseMoeBlock`). The blocks hold the weights; the maths is the runtime's (`ops::swiglu_mlp`,
//! `ops::moe_forward`: routing, the routed experts in ascending id, the shared expert's gate).
//!
//! Qwen3-Next adds the shared expert: `out += sigmoid(x · w_gate) · shared(x)`, its gate riding along as one
//! more router row.

use dflash_runtime::ops::{self, MlpWeights, MoeArgs};
use dflash_runtime::{DType, Tensor};

use crate::error::Result;
use crate::weights::WeightStore;

use super::config::MoeDims;
use super::rows::{linear, RowPlan};
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

    /// The weights as the runtime's MLP ops take them.
    pub(crate) fn weights(&self) -> MlpWeights<'_> {
        MlpWeights { gate_up: &self.gate_up, down: &self.down }
    }

    /// `x`: `[T, hidden]`; `out`: `[T, hidden]`, overwritten. Every row on its own (batch-invariant matmuls), so
    /// the row plan is not needed.
    pub(crate) fn forward(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        Ok(ops::swiglu_mlp(x, self.weights(), out)?)
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

    /// The router (and shared gate) logits, the shared expert, then `ops::moe_forward`.
    ///
    /// `x`: `[T, hidden]`; `out`: `[T, hidden]`, overwritten.
    pub(crate) fn forward(&self, plan: &RowPlan, x: &Tensor, out: &mut Tensor) -> Result<()> {
        let t = x.rows();
        let mut logits = Tensor::zeros(DType::F32, &[t, self.router.rows()])?; // [T, experts (+ 1)]
        linear(plan, x, &self.router, &mut logits)?;
        let shared = match &self.shared {
            Some(mlp) => {
                let mut ys = Tensor::zeros(DType::F32, &[t, x.row_len()])?; // [T, hidden]
                mlp.forward(x, &mut ys)?;
                Some(ys)
            }
            None => None,
        };
        let experts: Vec<MlpWeights> = self.experts.iter().map(Mlp::weights).collect();
        let args = MoeArgs {
            x,
            logits: &logits,
            experts: &experts,
            top_k: self.dims.top_k,
            norm_topk: self.dims.norm_topk_prob,
            shared: shared.as_ref(),
        };
        Ok(ops::moe_forward(args, out)?)
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
            Ffn::Dense(m) => m.forward(x, out),
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
