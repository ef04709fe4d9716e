//! The Llama family's CUDA forward: one step's kernels (embedding, the layers, the final norm and LM head),
//! queued by the shared step runner ([`crate::cuda::CudaCache::run_step`]) eagerly or into a graph.

use dflash_runtime::cuda::ops::{
    self as gpu, copy_columns, embedding_quant, gather_rms_norm, scatter_rows, small_gemm_fits, sum_sq_slots,
};
use dflash_runtime::cuda::DeviceBuf;

use super::model::{CudaLayer, CudaLlamaModel};
use crate::batch::{ForwardBatch, ForwardOut, Readout, StepDraws};
use crate::cuda::{
    apply_masks, attend, collect_drawn, collect_out, Block, CudaCache, DevMatrix, DevProjection, DevStreams, DevWeight,
    Linear, MatIn, MatOut, Next, Result, Step, StepPlan, Tap,
};
use crate::RowMasks;

impl CudaLlamaModel {
    /// Runs every row of `batch` (the same description as [`crate::llama::LlamaModel::forward`]), writing their
    /// K/V into `cache`; returns the logits of `batch.logit_rows` and the hidden states captured at the
    /// load-time layers, on the host. Uniform decode / verify batches replay a CUDA graph.
    ///
    /// # Errors
    /// A batch inconsistent in itself or with the cache's capacities, a cache made for another model, or
    /// a device failure.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut CudaCache) -> Result<ForwardOut> {
        self.forward_as(batch, cache, Readout::Logits)
    }

    /// As [`CudaLlamaModel::forward`], reading back what `readout` names: under [`Readout::Argmax`] each logit
    /// row's argmax instead of its logits (`L` ids rather than `L · vocab` floats).
    ///
    /// # Errors
    /// As [`CudaLlamaModel::forward`].
    pub fn forward_as(&self, batch: &ForwardBatch, cache: &mut CudaCache, readout: Readout) -> Result<ForwardOut> {
        let rows = self.run(batch, cache, readout)?;
        collect_out(&self.dev, &cache.ws, (self.cfg.vocab_size, self.capture_width()), batch, &rows, readout)
    }

    /// As [`CudaLlamaModel::forward_as`] under [`Readout::Argmax`], the rows of `masks` taking their argmax over
    /// the tokens their masks allow: the step is launched first, so the masks (computed on another thread) only
    /// have to be ready when its logits are.
    ///
    /// # Errors
    /// As [`CudaLlamaModel::forward`]; a mask for a row the step does not have.
    pub fn forward_masked(&self, batch: &ForwardBatch, cache: &mut CudaCache, masks: &RowMasks) -> Result<ForwardOut> {
        let rows = self.run(batch, cache, Readout::Argmax)?;
        apply_masks(&self.dev, &mut cache.ws, self.cfg.vocab_size, &rows, masks)?;
        let width = self.capture_width();
        collect_out(&self.dev, &cache.ws, (self.cfg.vocab_size, width), batch, &rows, Readout::Argmax)
    }

    /// As [`CudaLlamaModel::forward`], then draws each logit row on the device as `draws` say: the tokens, the
    /// logprobs asked for and the logits of `draws.host_rows` come back, not the other logits.
    ///
    /// # Errors
    /// As [`CudaLlamaModel::forward`]; draws that do not match the batch's logit rows.
    pub fn forward_drawn(&self, batch: &ForwardBatch, cache: &mut CudaCache, draws: &StepDraws) -> Result<ForwardOut> {
        let rows = self.run(batch, cache, Readout::Logits)?;
        let width = self.capture_width();
        collect_drawn(&self.dev, &mut cache.ws, (self.cfg.vocab_size, width), batch, &rows, draws)
    }

    /// The argmax of each logit row ([`CudaLlamaModel::forward_as`] with [`Readout::Argmax`]): what the kernel
    /// benchmarks time.
    ///
    /// # Errors
    /// As [`CudaLlamaModel::forward`].
    pub fn forward_greedy(&self, batch: &ForwardBatch, cache: &mut CudaCache) -> Result<Vec<u32>> {
        Ok(self.forward_as(batch, cache, Readout::Argmax)?.ids.unwrap_or_default())
    }

    fn run(&self, batch: &ForwardBatch, cache: &mut CudaCache, readout: Readout) -> Result<Vec<usize>> {
        let step = Step { batch, model: &self.cfg, model_id: self.id, tile_rows: self.tile_rows(), mixed_graphs: true };
        cache.run_step(
            &self.dev,
            step,
            readout,
            |_, _, _| {},
            |cache, plan, _, argmax| self.record_step(cache, plan, argmax),
        )
    }

    /// Queues one step's kernels (for eager runs and for graph capture alike): embedding, the layers, the
    /// final norm and LM head of the logit rows, and with `argmax` the greedy ids.
    fn record_step(&self, cache: &CudaCache, p: &StepPlan, argmax: bool) -> Result<()> {
        let (cfg, ws, lay) = (&self.cfg, &cache.ws, &p.layout);
        let (t, h) = (lay.t, cfg.hidden_size);
        let inputs = ws.inputs.view();
        let input = |r: std::ops::Range<usize>| inputs.sub(r.start, r.len());
        let residual = ws.residual.view().prefix(t * h)?;
        let tokens = input(lay.tokens())?;
        match &self.embed.w {
            DevWeight::Bf16(table) => gpu::embedding_bf16(&self.dev, table, tokens, residual)?,
            DevWeight::F32(table) => gpu::embedding_f32(&self.dev, table, tokens, residual)?,
            DevWeight::Quant(table) => embedding_quant(&self.dev, table, tokens, residual)?,
        }
        match &self.streams {
            None => self.plain_layers(cache, p)?,
            Some(streams) => self.stream_layers(cache, p, streams)?,
        }
        if let Some(pages) = &cache.captured_pages {
            let width = self.capture_width();
            scatter_rows(&self.dev, ws.captured.view().prefix(t * width)?, input(lay.slots())?, pages.view(), width)?;
        }
        let l = lay.l;
        let logits_in = ws.logits_in.view().prefix(l * h)?;
        gather_rms_norm(&self.dev, residual, input(lay.logit_rows())?, &self.final_norm, cfg.rms_norm_eps, logits_in)?;
        let logits = ws.logits.view().prefix(l * cfg.vocab_size)?;
        let head = self.lm_head();
        self.linear().matmul(
            ws,
            l,
            MatIn::Plain(logits_in),
            head,
            MatOut::Store { y: logits, ld: cfg.vocab_size, col: 0 },
        )?;
        if argmax {
            gpu::argmax_rows(&self.dev, logits, cfg.vocab_size, ws.ids.view().prefix(l)?, &ws.argmax)?;
        }
        Ok(())
    }

    /// The layers over one residual stream, each block adding to `residual`.
    fn plain_layers(&self, cache: &CudaCache, p: &StepPlan) -> Result<()> {
        let (ws, t, h) = (&cache.ws, p.layout.t, self.cfg.hidden_size);
        let residual = ws.residual.view().prefix(t * h)?;
        let fold = self.folds_norms(t);
        let width = self.capture_width();
        for (i, layer) in self.layers.iter().enumerate() {
            let add = MatOut::Add {
                y: residual,
                sum_sq: fold.then(|| ws.sum_sq.view().prefix(t * sum_sq_slots(h))).transpose()?,
            };
            self.layer(cache, p, i, layer, fold, add)?;
            if let Some(tap) = self.capture_layers.iter().position(|&l| l == i) {
                copy_columns(&self.dev, residual, h, ws.captured.view().prefix(t * width)?, width, tap * h)?;
            }
        }
        Ok(())
    }

    /// The layers over hyper-connection streams: each block enters through its connection (its input collapsed
    /// into `residual`), writes its output to `delta` and leaves by mixing it back; the head's collapse ends in
    /// `residual` for the final norm. No norm folding (the blocks' inputs are not the matmuls' residual).
    fn stream_layers(&self, cache: &CudaCache, p: &StepPlan, streams: &DevStreams) -> Result<()> {
        let (ws, t, h) = (&cache.ws, p.layout.t, self.cfg.hidden_size);
        let store = MatOut::Store { y: ws.delta.view().prefix(t * h)?, ld: h, col: 0 };
        streams.enter_model(&self.dev, ws, t, self.layers.len())?;
        for (i, layer) in self.layers.iter().enumerate() {
            self.stream_layer(cache, p, streams, i, layer, store)?;
        }
        Ok(())
    }

    /// One decoder layer, entered through its mixer's connection: the attention, the exit into the feed-forward's
    /// connection, the MLP, and the exit (with the layer's tap, if read) into the next layer or the head.
    fn stream_layer<'a>(
        &'a self,
        cache: &'a CudaCache,
        p: &StepPlan,
        streams: &DevStreams,
        i: usize,
        layer: &'a CudaLayer,
        out: MatOut<'a>,
    ) -> Result<()> {
        let (ws, t, h) = (&cache.ws, p.layout.t, self.cfg.hidden_size);
        let residual = ws.residual.view().prefix(t * h)?;
        self.attention_block(cache, p, i, layer, MatIn::Normed { x: residual, w: layer.attn_norm.view() }, out)?;
        streams.leave(&self.dev, ws, t, None, Next::Block(i, Block::Ffn))?;
        let act = ws.act.view().prefix(t * self.cfg.intermediate_size)?;
        let input = MatIn::Normed { x: residual, w: layer.ffn_norm.view() };
        self.linear().mlp(ws, t, input, (&layer.gate_up, &layer.down), act, out)?;
        let tap =
            self.capture_layers.iter().position(|&l| l == i).map(|index| Tap { index, width: self.capture_width() });
        streams.leave(&self.dev, ws, t, tap, Next::after_layer(i, self.layers.len()))
    }

    /// One decoder layer on the step's rows. With `fold`, the pre-norms run inside the matmuls after them, from
    /// the sums of squares the residual's last matmul left (the first layer's attention norm, after the
    /// embedding, keeps its kernel).
    fn layer<'a>(
        &'a self,
        cache: &'a CudaCache,
        p: &StepPlan,
        i: usize,
        layer: &'a CudaLayer,
        fold: bool,
        add: MatOut<'a>,
    ) -> Result<()> {
        let (cfg, ws, lay) = (&self.cfg, &cache.ws, &p.layout);
        let (t, h) = (lay.t, cfg.hidden_size);
        let f = cfg.intermediate_size;
        let residual = ws.residual.view().prefix(t * h)?;
        let sum_sq = ws.sum_sq.view().prefix(t * sum_sq_slots(h))?;
        let pre_norm = |norm: &'a DeviceBuf<f32>, after_matmul: bool| match fold && after_matmul {
            true => MatIn::Folded { x: residual, w: norm.view(), sum_sq },
            false => MatIn::Normed { x: residual, w: norm.view() },
        };
        self.attention_block(cache, p, i, layer, pre_norm(&layer.attn_norm, i > 0), add)?;
        let act = ws.act.view().prefix(t * f)?;
        let mlp = (&layer.gate_up, &layer.down);
        self.linear().mlp(ws, t, pre_norm(&layer.ffn_norm, true), mlp, act, add)
    }

    /// Layer `i`'s attention of `input` (`[t, hidden]`, normed as it says) into `out`.
    fn attention_block<'a>(
        &'a self,
        cache: &'a CudaCache,
        p: &StepPlan,
        i: usize,
        layer: &'a CudaLayer,
        input: MatIn<'a>,
        out: MatOut<'a>,
    ) -> Result<()> {
        let (cfg, ws, t) = (&self.cfg, &cache.ws, p.layout.t);
        let qkv_w = cfg.qkv_width();
        let qkv = ws.qkv.view().prefix(t * qkv_w)?;
        self.linear().project(ws, t, input, &layer.qkv, MatOut::Store { y: qkv, ld: qkv_w, col: 0 })?;
        let norms = (layer.q_norm.as_ref().map(|n| n.view()), layer.k_norm.as_ref().map(|n| n.view()));
        let attn = attend(&self.dev, cache, p, i, (qkv, qkv_w), &self.rope, norms, cfg)?;
        self.linear().matmul(ws, t, MatIn::Plain(attn), &layer.o_proj, out)
    }

    /// Whether a step of `t` rows folds the pre-norms into its matmuls: every layer matrix bf16 and small enough
    /// for the small bf16 matmul (the one kernel that leaves and takes the sums of squares), and not turned off
    /// with `DFLASH_FOLD_NORM=0` (for side-by-side measurements).
    fn folds_norms(&self, t: usize) -> bool {
        let off = dflash_runtime::switches::switches().no_fold_norm;
        let small = |m: &DevMatrix| matches!(m.w, DevWeight::Bf16(_)) && small_gemm_fits(t, m.k);
        let proj = |p: &DevProjection| match p {
            DevProjection::Fused(m) => small(m),
            DevProjection::Split(parts) => parts.iter().all(small),
        };
        !off && self.layers.iter().all(|l| proj(&l.qkv) && proj(&l.gate_up) && small(&l.o_proj) && small(&l.down))
    }

    pub(crate) fn linear(&self) -> Linear<'_> {
        Linear { dev: &self.dev, eps: self.cfg.rms_norm_eps }
    }
}
