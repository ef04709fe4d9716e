//! The SwiGLU MLP and the sparse mixture-of-experts block (HF `Qwen3MoeSparseMoeBlock`,
//! `Qwen3NextSparseMoeBlock`), twin of `cuda::ops::moe_forward`.
//!
//! Routing: `p = softmax(logits)` in f32, the `top_k` largest (ties to the lower expert id), renormalised to
//! sum to one when asked. Each routed expert runs on the rows routed to it only, and a row's expert outputs are
//! added in ascending expert order (`out = Σₑ pₑ · expertₑ(x)`), as HF's expert loop does, so a row's result
//! does not depend on the other rows. A shared expert's output (computed by the caller) comes last, weighted
//! by `sigmoid` of the logit column after the experts'.

use super::{f32_rows, gather_rows, matmul, shape_err, softmax_in_place, swiglu_fused};
use crate::{DType, Result, Tensor};

/// The weights of one SwiGLU MLP (a dense block, or one expert).
#[derive(Clone, Copy, Debug)]
pub struct MlpWeights<'a> {
    pub gate_up: &'a Tensor, // [2·inter, hidden]: the gate rows, then the up rows
    pub down: &'a Tensor,    // [hidden, inter]
}

/// `out = down(silu(gate(x)) · up(x))`, every row on its own (the matmuls are batch-invariant).
///
/// `x`: `[T, hidden]` f32; `out`: `[T, hidden]` f32, overwritten.
///
/// # Errors
/// Shape or dtype mismatches.
pub fn swiglu_mlp(x: &Tensor, w: MlpWeights, out: &mut Tensor) -> Result<()> {
    let t = x.rows();
    let mut gate_up = Tensor::zeros(DType::F32, &[t, w.gate_up.rows()])?; // [T, 2·inter]
    matmul(x, w.gate_up, &mut gate_up)?;
    let mut act = Tensor::zeros(DType::F32, &[t, w.down.row_len()])?; // [T, inter]
    swiglu_fused(&gate_up, &mut act)?;
    matmul(&act, w.down, out)
}

/// Each row's `(expert, weight)` picks, best first: the `top_k` largest of `softmax(logits[t, 0..E])` (equal
/// probabilities to the lower id), divided by their sum when `norm_topk`.
///
/// `logits`: `[T, ≥ num_experts]` f32 (further columns ignored).
///
/// # Errors
/// `top_k` not in `1..=num_experts`, logits narrower than `num_experts` or not f32.
pub fn moe_route(logits: &Tensor, num_experts: usize, top_k: usize, norm_topk: bool) -> Result<Vec<Vec<(usize, f32)>>> {
    let width = logits.row_len();
    f32_rows(logits, width, "moe_route logits")?;
    if top_k == 0 || top_k > num_experts || width < num_experts {
        return Err(shape_err(format!("moe_route: {top_k} of {num_experts} experts, logit rows of {width}")));
    }
    let routes = logits
        .as_f32()?
        .chunks_exact(width)
        .map(|row| {
            let mut probs = row[..num_experts].to_vec();
            softmax_in_place(&mut probs);
            let top = super::top_k(&probs, top_k);
            let sum: f32 = top.iter().map(|&(_, p)| p).sum();
            let norm = if norm_topk { sum } else { 1.0 };
            top.iter().map(|&(id, p)| (id as usize, p / norm)).collect()
        })
        .collect();
    Ok(routes)
}

/// [`moe_forward`]'s inputs.
#[derive(Clone, Copy, Debug)]
pub struct MoeArgs<'a> {
    pub x: &'a Tensor, // [T, hidden]
    /// `[T, ≥ E]`: expert logits in columns `0..E`; with `shared`, the shared expert's gate logit in column `E`.
    pub logits: &'a Tensor,
    /// The `E` routed experts.
    pub experts: &'a [MlpWeights<'a>],
    pub top_k: usize,
    /// Renormalise the picked probabilities to sum to one.
    pub norm_topk: bool,
    /// The shared expert's output, added with weight `sigmoid(logits[t, E])`.
    pub shared: Option<&'a Tensor>, // [T, hidden]
}

/// `out = Σ_picks w · expert(x) (+ sigmoid(gate) · shared)`, the experts in ascending id, each run only on the
/// rows that picked it.
///
/// `out`: `[T, hidden]` f32, overwritten.
///
/// # Errors
/// Shape or dtype mismatches, routing arguments [`moe_route`] refuses.
pub fn moe_forward(a: MoeArgs, out: &mut Tensor) -> Result<()> {
    let (e, hidden) = (a.experts.len(), a.x.row_len());
    let t = f32_rows(a.x, hidden, "moe_forward x")?;
    let logit_cols = e + usize::from(a.shared.is_some());
    if hidden == 0
        || f32_rows(out, hidden, "moe_forward out")? != t
        || a.logits.rows() != t
        || a.logits.row_len() < logit_cols
        || a.shared.is_some_and(|s| s.shape() != a.x.shape())
    {
        return Err(shape_err(format!(
            "moe_forward: x {:?}, logits {:?} for {e} experts, shared {:?}, out {:?}",
            a.x.shape(),
            a.logits.shape(),
            a.shared.map(Tensor::shape),
            out.shape()
        )));
    }
    let routes = moe_route(a.logits, e, a.top_k, a.norm_topk)?;
    let dst = out.as_f32_mut()?;
    dst.fill(0.0);
    for (id, expert) in a.experts.iter().enumerate() {
        add_expert(a.x, id, *expert, &routes, dst)?;
    }
    if let Some(shared) = a.shared {
        let (lg, width) = (a.logits.as_f32()?, a.logits.row_len());
        for (r, y) in shared.as_f32()?.chunks_exact(hidden).enumerate() {
            let g = 1.0 / (1.0 + (-lg[r * width + e]).exp());
            for (o, &v) in dst[r * hidden..(r + 1) * hidden].iter_mut().zip(y) {
                *o += g * v;
            }
        }
    }
    Ok(())
}

/// `dst[r] += w · expert(x[r])` for every row `r` that picked expert `id` (with weight `w`).
fn add_expert(
    x: &Tensor, // [T, hidden]
    id: usize,
    expert: MlpWeights,
    routes: &[Vec<(usize, f32)>],
    dst: &mut [f32], // [T, hidden]
) -> Result<()> {
    let hidden = x.row_len();
    let picked: Vec<(usize, f32)> = routes
        .iter()
        .enumerate()
        .filter_map(|(r, row)| row.iter().find(|(pick, _)| *pick == id).map(|&(_, w)| (r, w)))
        .collect();
    if picked.is_empty() {
        return Ok(());
    }
    let rows: Vec<usize> = picked.iter().map(|&(r, _)| r).collect();
    let xs = gather_rows(x, &rows)?;
    let mut ys = Tensor::zeros(DType::F32, &[rows.len(), hidden])?; // [picked rows, hidden]
    swiglu_mlp(&xs, expert, &mut ys)?;
    for (y, &(r, w)) in ys.as_f32()?.chunks_exact(hidden).zip(&picked) {
        for (o, &v) in dst[r * hidden..(r + 1) * hidden].iter_mut().zip(y) {
            *o += v * w;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn silu(v: f32) -> f32 {
        v / (1.0 + (-v).exp())
    }

    #[test]
    fn routes_top_k_and_renormalises_on_request() {
        // Expert e: gate = up = e + 1 on x = (1, 0), down = 1: y = silu(s) · s for s = e + 1.
        let weights: Vec<(Tensor, Tensor)> = (0..3)
            .map(|e| {
                let s = e as f32 + 1.0;
                let gate_up = Tensor::from_f32(&[s, s, s, s], &[2, 2]).expect("gate_up");
                (gate_up, Tensor::from_f32(&[1.0, 1.0], &[2, 1]).expect("down"))
            })
            .collect();
        let experts: Vec<MlpWeights> = weights.iter().map(|(gate_up, down)| MlpWeights { gate_up, down }).collect();
        let x = Tensor::from_f32(&[1.0, 0.0], &[1, 2]).expect("x");
        let lg = [0.0f32, 2.0, 1.0];
        let logits = Tensor::from_f32(&lg, &[1, 3]).expect("logits");
        let z: f32 = lg.iter().map(|l| l.exp()).sum();
        let (p1, p2) = (2f32.exp() / z, 1f32.exp() / z);
        for norm_topk in [false, true] {
            let mut out = Tensor::zeros(DType::F32, &[1, 2]).expect("out");
            let args = MoeArgs { x: &x, logits: &logits, experts: &experts, top_k: 2, norm_topk, shared: None };
            moe_forward(args, &mut out).expect("forward");
            let (w1, w2) = if norm_topk { (p1 / (p1 + p2), p2 / (p1 + p2)) } else { (p1, p2) };
            // Experts 1 (p1) and 2 (p2) win; expert 0 is not evaluated.
            let want = w1 * silu(2.0) * 2.0 + w2 * silu(3.0) * 3.0;
            let got = out.as_f32().expect("f32")[0];
            assert!((got - want).abs() < 1e-5, "norm {norm_topk}: {got} vs {want}");
        }
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_bad_arguments_are_refused() {
        let logits = Tensor::from_f32(&[1.0, 3.0, 3.0, 3.0, 0.5], &[1, 5]).expect("logits");
        let picks = moe_route(&logits, 4, 2, false).expect("route");
        assert_eq!(picks[0].iter().map(|&(id, _)| id).collect::<Vec<_>>(), vec![1, 2]);
        assert!(moe_route(&logits, 4, 0, false).is_err());
        assert!(moe_route(&logits, 4, 5, false).is_err());
        assert!(moe_route(&logits, 6, 2, false).is_err());
        let x = Tensor::from_f32(&[1.0, 0.0], &[1, 2]).expect("x");
        let mut out = Tensor::zeros(DType::F32, &[1, 2]).expect("out");
        let shared = Tensor::zeros(DType::F32, &[2, 2]).expect("shared");
        let args = MoeArgs { x: &x, logits: &logits, experts: &[], top_k: 1, norm_topk: false, shared: Some(&shared) };
        assert!(moe_forward(args, &mut out).is_err(), "shared rows other than x's");
    }
}
