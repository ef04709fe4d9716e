//! The MTP heads' golden check, shared by the host's parity tests and the CUDA head's.

use std::collections::HashMap;

use dflash_models::{MtpHead, TargetHeads};
use dflash_runtime::Tensor;

use super::{assert_close, Golden};

/// Tolerance of the golden checks (relative, f32 against the references' f32).
pub const TOL: f32 = 1e-4;

pub fn ids(g: &Golden) -> Vec<u32> {
    g.data.iter().map(|&x| x as u32).collect()
}

pub fn rows(data: &[f32], from: usize, to: usize, width: usize) -> Tensor {
    Tensor::from_f32(&data[from * width..to * width], &[to - from, width]).expect("rows")
}

/// Checks `head` on `target`'s heads against the golden `g`, given the trunk's captured last layer `trunk`.
pub fn check_head(what: &str, head: &MtpHead, target: &dyn TargetHeads, trunk: &[f32], g: &HashMap<String, Golden>) {
    let tokens = ids(&g["input_ids"]);
    let (h, v) = (head.config().hidden_size(), head.config().vocab_size());
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    head.check_target(embed, lm_head).expect("the head fits its target");
    let n = tokens.len() - 1;
    let want = &g["depth1_logits"].data;

    let mut ctx = head.new_context().expect("context");
    let out = head.append(&mut ctx, embed, &rows(trunk, 0, n, h), &tokens[1..]).expect("append");
    let logits = head.logits(lm_head, &out).expect("logits");
    assert_close(&format!("{what}: depth-1 logits"), logits.as_f32().expect("f32"), want, TOL);
    assert_eq!(ctx.len(), n);

    let mut ctx = head.new_context().expect("context");
    let mut got = Vec::new();
    for (a, b) in [(0, 5), (5, n)] {
        let out = head.append(&mut ctx, embed, &rows(trunk, a, b, h), &tokens[a + 1..b + 1]).expect("append");
        got.extend_from_slice(head.logits(lm_head, &out).expect("logits").as_f32().expect("f32"));
    }
    assert_close(&format!("{what}: depth-1 logits appended in two calls"), &got, want, TOL);

    let c = g["chain_start"].data[0] as usize;
    let chain = &g["chain_logits"].data;
    let mut ctx = head.new_context().expect("context");
    let out = head.append(&mut ctx, embed, &rows(trunk, 0, c + 1, h), &tokens[1..c + 2]).expect("append");
    let mut previous = rows(out.as_f32().expect("f32"), c, c + 1, h);
    let first = head.logits(lm_head, &previous).expect("logits");
    assert_close(&format!("{what}: chain depth 1"), first.as_f32().expect("f32"), &chain[..v], TOL);
    for step in 0..2 {
        previous = head.chain(&mut ctx, embed, &previous, tokens[c + 2 + step], step).expect("chain step");
        let logits = head.logits(lm_head, &previous).expect("logits");
        let depth = step + 2;
        let want = &chain[(depth - 1) * v..depth * v];
        assert_close(&format!("{what}: chain depth {depth}"), logits.as_f32().expect("f32"), want, TOL);
    }
    // The chain wrote scratch slots only: the next committed entry is the plain depth-1 one.
    assert_eq!(ctx.len(), c + 1);
    let out = head.append(&mut ctx, embed, &rows(trunk, c + 1, c + 2, h), &tokens[c + 2..c + 3]).expect("append");
    let logits = head.logits(lm_head, &out).expect("logits");
    assert_close(
        &format!("{what}: entry after a chain"),
        logits.as_f32().expect("f32"),
        &want[(c + 1) * v..(c + 2) * v],
        TOL,
    );
}
