//! The head's forward on the host: committed entries appended to a sequence's history, chained draft steps past
//! it, and logits through the target's LM head.

use dflash_runtime::ops;
use dflash_runtime::{DType, Tensor};

use crate::batch::{ForwardBatch, SeqRows};
use crate::error::{ModelError, Result};
use crate::hybrid::rows::RowPlan;
use crate::mtp::{Entries, MtpContext, MtpHead};

impl MtpHead {
    /// [`MtpHead::logits`] on the host.
    pub(crate) fn logits_host(&self, lm_head: &Tensor, out: &Tensor) -> Result<Tensor> {
        let mut logits = Tensor::zeros(DType::F32, &[out.rows(), lm_head.rows()])?;
        ops::matmul(out, lm_head, &mut logits)?;
        Ok(logits)
    }

    /// The head on the host over `entries` (trunk rows normed by the target's final norm first). Returns the outputs
    /// `[n, hidden]` after `mtp.norm`.
    pub(crate) fn run_host(&self, ctx: &mut MtpContext, embedding: &Tensor, entries: Entries<'_>) -> Result<Tensor> {
        let Entries { input, tokens, first, trunk } = entries;
        if !trunk {
            return self.run(ctx, embedding, input, tokens, first, false);
        }
        let mut hidden = Tensor::zeros(DType::F32, input.shape())?;
        ops::rms_norm(input, &self.trunk_norm.weight, self.trunk_norm.eps, &mut hidden)?;
        self.run(ctx, embedding, &hidden, tokens, first, true)
    }

    pub(crate) fn check_rows(&self, x: &Tensor, rows: usize) -> Result<()> {
        let h = self.cfg.hidden_size();
        if x.shape() != [rows, h] {
            return Err(ModelError::Batch(format!("MTP input {:?} for {rows} rows of {h}", x.shape())));
        }
        Ok(())
    }

    /// The head over rows at positions `first ..` with normed hidden inputs `hidden` `[n, hidden]` and their next
    /// tokens; writes their K/V at the same slots. Committed rows attend as one block (the tiled kernel), chained
    /// steps one row at a time, like a target's prompt and generated rows.
    fn run(
        &self,
        ctx: &mut MtpContext,
        embedding: &Tensor,
        hidden: &Tensor, // [n, hidden]
        tokens: &[u32],
        first: usize,
        committed: bool,
    ) -> Result<Tensor> {
        let (n, h, eps) = (tokens.len(), self.cfg.hidden_size(), self.cfg.eps());
        if n == 0 {
            return Ok(Tensor::zeros(DType::F32, &[0, h])?);
        }
        let mut x = self.combine(embedding, hidden, tokens)?; // [n, hidden]
        let host = ctx.host_reserve(first + n)?;
        let positions: Vec<u32> = (first..first + n).map(|p| p as u32).collect();
        let seqs = [SeqRows {
            num_rows: n,
            context_len: first,
            block_table: &host.block_table,
            prompt_len: if committed { first + n } else { 0 },
        }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &[] };
        let plan = RowPlan::from_batch(&batch);
        let mut normed = Tensor::zeros(DType::F32, &[n, h])?;
        let mut delta = Tensor::zeros(DType::F32, &[n, h])?;
        ops::rms_norm(&x, &self.attn_norm, eps, &mut normed)?;
        self.attn.forward(&plan, &batch, &mut host.kv, 0, &self.rope, &normed, &mut delta)?;
        ops::add_rms_norm(&mut x, &delta, &self.ffn_norm, eps, &mut normed)?;
        self.ffn.forward(&plan, &normed, &mut delta)?;
        ops::add_in_place(&mut x, &delta)?;
        let mut out = Tensor::zeros(DType::F32, &[n, h])?;
        ops::rms_norm(&x, &self.norm, eps, &mut out)?;
        Ok(out)
    }

    /// `fc([pre_fc_norm_embedding(embed(tokens)) | pre_fc_norm_hidden(hidden)])`: `[n, hidden]`.
    fn combine(&self, embedding: &Tensor, hidden: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        let (n, h, eps) = (tokens.len(), self.cfg.hidden_size(), self.cfg.eps());
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= embedding.rows()) {
            return Err(ModelError::Batch(format!("token {t} outside a vocabulary of {}", embedding.rows())));
        }
        let mut emb = Tensor::zeros(DType::F32, &[n, h])?;
        ops::embedding(embedding, tokens, &mut emb)?;
        let mut e = Tensor::zeros(DType::F32, &[n, h])?;
        ops::rms_norm(&emb, &self.pre_fc_norm_embedding, eps, &mut e)?;
        let mut hn = Tensor::zeros(DType::F32, &[n, h])?;
        ops::rms_norm(hidden, &self.pre_fc_norm_hidden, eps, &mut hn)?;
        let mut joined = Tensor::zeros(DType::F32, &[n, 2 * h])?;
        {
            let (e, hn) = (e.as_f32()?, hn.as_f32()?);
            for (r, row) in joined.as_f32_mut()?.chunks_exact_mut(2 * h).enumerate() {
                row[..h].copy_from_slice(&e[r * h..(r + 1) * h]);
                row[h..].copy_from_slice(&hn[r * h..(r + 1) * h]);
            }
        }
        let mut x = Tensor::zeros(DType::F32, &[n, h])?;
        ops::matmul(&joined, &self.fc, &mut x)?;
        Ok(x)
    }
}
