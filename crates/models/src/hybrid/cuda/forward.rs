//! The hybrid forward on the device: one step's kernels (eager, or captured per (batch bucket, rows) and
//! replayed), the per-sequence GDN runs riding in the step's one input copy, and the rollback replay.

use dflash_runtime::cuda::ops::{
    self as gpu, copy_columns, embedding_quant, gather_rms_norm, gdn_conv, gdn_gated_norm, gdn_prep, gdn_rule,
    moe_forward, sigmoid_gate_mul, GdnConvArgs, GdnPrepArgs, GdnRuleArgs, GdnRuns, GdnStateView, MoeArgs,
};
use dflash_runtime::cuda::DevSlice;

use super::cache::CudaHybridCache;
use super::{CudaHybridModel, DevAttention, DevFfn, DevGdn, DevHybridLayer, DevMixer, DevMoe, GdnSeq};
use crate::batch::{ForwardBatch, ForwardOut, Readout, StepDraws};
use crate::cuda::{
    apply_masks, attend, collect_drawn, collect_out, Block, CudaModelError, DevStreams, DevWeight, Linear, MatIn,
    MatOut, Next, Result, Step, StepPlan, Tap,
};

impl CudaHybridModel {
    /// Runs every row of `batch` (as [`crate::hybrid::HybridModel::forward`]), `seqs[i]` naming the state
    /// slot of `batch.seqs[i]` and whether this is its verify; returns the logits of `batch.logit_rows`
    /// and the captured hidden states on the host. Uniform decode / verify batches replay a CUDA graph.
    ///
    /// # Errors
    /// A batch inconsistent in itself or with the cache, slots out of range or repeated, a verify still
    /// awaiting [`CudaHybridModel::rollback`], a cache made for another model, a device failure.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut CudaHybridCache, seqs: &[GdnSeq]) -> Result<ForwardOut> {
        self.forward_as(batch, cache, seqs, Readout::Logits)
    }

    /// As [`CudaHybridModel::forward`], reading back what `readout` names: under [`Readout::Argmax`] each logit
    /// row's argmax instead of its logits.
    ///
    /// # Errors
    /// As [`CudaHybridModel::forward`].
    pub fn forward_as(
        &self,
        batch: &ForwardBatch,
        cache: &mut CudaHybridCache,
        seqs: &[GdnSeq],
        readout: Readout,
    ) -> Result<ForwardOut> {
        let rows = self.run(batch, cache, seqs, readout)?;
        let width = self.capture_width();
        let out = collect_out(&self.dev, &cache.ws, (self.cfg.base.vocab_size, width), batch, &rows, readout)?;
        set_pending(batch, cache, seqs);
        Ok(out)
    }

    /// As [`CudaHybridModel::forward_as`] under [`Readout::Argmax`], the rows of `masks` taking their argmax over
    /// the tokens their masks allow (waited for once the step is launched).
    ///
    /// # Errors
    /// As [`CudaHybridModel::forward`]; a mask for a row the step does not have.
    pub fn forward_masked(
        &self,
        batch: &ForwardBatch,
        cache: &mut CudaHybridCache,
        seqs: &[GdnSeq],
        masks: &crate::RowMasks,
    ) -> Result<ForwardOut> {
        let rows = self.run(batch, cache, seqs, Readout::Argmax)?;
        apply_masks(&self.dev, &mut cache.ws, self.cfg.base.vocab_size, &rows, masks)?;
        let width = self.capture_width();
        let out = collect_out(&self.dev, &cache.ws, (self.cfg.base.vocab_size, width), batch, &rows, Readout::Argmax)?;
        set_pending(batch, cache, seqs);
        Ok(out)
    }

    /// As [`CudaHybridModel::forward`], then draws each logit row on the device as `draws` say: the tokens, the
    /// logprobs asked for and the logits of `draws.host_rows` come back, not the other logits.
    ///
    /// # Errors
    /// As [`CudaHybridModel::forward`]; draws that do not match the batch's logit rows.
    pub fn forward_drawn(
        &self,
        batch: &ForwardBatch,
        cache: &mut CudaHybridCache,
        seqs: &[GdnSeq],
        draws: &StepDraws,
    ) -> Result<ForwardOut> {
        let rows = self.run(batch, cache, seqs, Readout::Logits)?;
        let width = self.capture_width();
        let out = collect_drawn(&self.dev, &mut cache.ws, (self.cfg.base.vocab_size, width), batch, &rows, draws)?;
        set_pending(batch, cache, seqs);
        Ok(out)
    }

    /// The argmax of each logit row ([`CudaHybridModel::forward_as`] with [`Readout::Argmax`]).
    ///
    /// # Errors
    /// As [`CudaHybridModel::forward`].
    pub fn forward_greedy(
        &self,
        batch: &ForwardBatch,
        cache: &mut CudaHybridCache,
        seqs: &[GdnSeq],
    ) -> Result<Vec<u32>> {
        Ok(self.forward_as(batch, cache, seqs, Readout::Argmax)?.ids.unwrap_or_default())
    }

    /// Resolves the last forward's verifies: `kept[i]` rows of the `i`-th verifying sequence (in batch
    /// order) are kept, the rest rejected. Replays the kept rows into the conv and recurrent state of every
    /// GDN layer (two launches, queued; no synchronisation). The attention layers need nothing: the caller
    /// cuts the sequence's length.
    ///
    /// # Errors
    /// No verify pending, a count per verifying sequence other than one, a kept count over the rows.
    pub fn rollback(&self, cache: &mut CudaHybridCache, kept: &[usize]) -> Result<()> {
        let pending = std::mem::take(&mut cache.extra.pending);
        if pending.len() != kept.len() || pending.iter().zip(kept).any(|(p, &k)| k > p[1] as usize) {
            return Err(CudaModelError::Batch(format!("rollback of {kept:?} for verifies {pending:?}")));
        }
        let g = cache.extra.gdn;
        if g.layers == 0 || pending.is_empty() {
            return Ok(());
        }
        let host: Vec<u32> = pending.iter().zip(kept).flat_map(|(p, &k)| [p[0], k as u32, p[2], 1]).collect();
        self.dev.upload_prefix(&host, &mut cache.extra.hy.replay_runs)?;
        let hy = &cache.extra.hy;
        let t_cap = cache.cfg.max_tokens;
        let runs = GdnRuns { runs: hy.replay_runs.view().prefix(host.len())?, rows: t_cap };
        let d = self.gdn_dims()?;
        let conv_state = GdnStateView {
            state: hy.conv_state.view(),
            layer_stride: g.conv_state,
            slot_stride: g.layers * g.conv_state,
            slots: cache.extra.slots + 1,
        };
        gdn_conv(
            &self.dev,
            GdnConvArgs {
                x: hy.proj.view(),
                x_ld: g.proj,
                x_layer: t_cap * g.proj,
                w: None,
                state: conv_state,
                runs,
                layers: g.layers,
                channels: g.conv,
                kernel: d.conv_kernel,
                out: None,
            },
        )?;
        let ssm = GdnStateView {
            state: hy.ssm.view(),
            layer_stride: g.ssm,
            slot_stride: g.layers * g.ssm,
            slots: cache.extra.slots + 1,
        };
        gdn_rule(
            &self.dev,
            GdnRuleArgs {
                qkv: hy.conv_out.view(),
                channels: g.conv,
                qkv_layer: t_cap * g.conv,
                gb: hy.gb.view(),
                gb_layer: t_cap * g.gb,
                state: ssm,
                runs,
                layers: g.layers,
                k_heads: d.num_k_heads,
                v_heads: d.num_v_heads,
                k_head_dim: d.k_head_dim,
                v_head_dim: d.v_head_dim,
                out: None,
            },
        )?;
        Ok(())
    }

    /// Zeroes a state slot (a sequence starting over).
    ///
    /// # Errors
    /// A slot out of range, a device failure.
    pub fn reset_slot(&self, cache: &mut CudaHybridCache, slot: usize) -> Result<()> {
        let g = cache.extra.gdn;
        if slot >= cache.extra.slots {
            return Err(CudaModelError::Batch(format!("state slot {slot} of {}", cache.extra.slots)));
        }
        for (buf, per) in [(&cache.extra.hy.conv_state, g.conv_state), (&cache.extra.hy.ssm, g.ssm)] {
            let n = g.layers * per;
            if n > 0 {
                // Scale and offset 0: the fill writes zeros.
                gpu::fill_random_f32(&self.dev, buf.view().sub(slot * n, n)?, 0, 0.0, 0.0)?;
            }
        }
        Ok(())
    }

    /// One state slot's conv and recurrent state over every GDN layer, `[layers, kernel − 1, conv_dim]`
    /// and `[layers, v_heads, k_head_dim, v_head_dim]` (tests and debugging; synchronises).
    ///
    /// # Errors
    /// A slot out of range, a device failure.
    pub fn read_state(&self, cache: &CudaHybridCache, slot: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let g = cache.extra.gdn;
        if slot > cache.extra.slots {
            return Err(CudaModelError::Batch(format!("state slot {slot} of {}", cache.extra.slots)));
        }
        let (mut conv, mut ssm) = (vec![0f32; g.layers * g.conv_state], vec![0f32; g.layers * g.ssm]);
        self.dev.download_into(&cache.extra.hy.conv_state, slot * conv.len(), &mut conv)?;
        self.dev.download_into(&cache.extra.hy.ssm, slot * ssm.len(), &mut ssm)?;
        self.dev.synchronize()?;
        Ok((conv, ssm))
    }

    /// Installs a state slot's conv and recurrent state (as [`CudaHybridModel::read_state`] gives them).
    ///
    /// # Errors
    /// A slot out of range, lengths other than one slot's, a device failure.
    pub fn write_state(&self, cache: &mut CudaHybridCache, slot: usize, conv: &[f32], ssm: &[f32]) -> Result<()> {
        let g = cache.extra.gdn;
        let (nc, ns) = (g.layers * g.conv_state, g.layers * g.ssm);
        if slot >= cache.extra.slots || conv.len() != nc || ssm.len() != ns {
            return Err(CudaModelError::Batch(format!(
                "state for slot {slot} of {}: {} + {} floats, want {nc} + {ns}",
                cache.extra.slots,
                conv.len(),
                ssm.len()
            )));
        }
        self.dev.upload_at(conv, &mut cache.extra.hy.conv_state, slot * nc)?;
        self.dev.upload_at(ssm, &mut cache.extra.hy.ssm, slot * ns)?;
        Ok(())
    }

    fn gdn_dims(&self) -> Result<crate::hybrid::GdnDims> {
        self.cfg.gdn.ok_or_else(|| CudaModelError::Unsupported("GDN layers without GDN dims".into()))
    }

    /// Validates, plans (the dense inputs, then the GDN runs: first row, rows, state slot, write flag per
    /// sequence), uploads and runs the step. Returns the device row of each requested logit row.
    fn run(
        &self,
        batch: &ForwardBatch,
        cache: &mut CudaHybridCache,
        seqs: &[GdnSeq],
        readout: Readout,
    ) -> Result<Vec<usize>> {
        self.check(batch, cache, seqs)?;
        let spare_slot = cache.extra.slots as u32;
        let runs = |host: &mut Vec<u32>, plan: &StepPlan, graph_rows: usize| {
            let mut first = 0u32;
            for (s, g) in batch.seqs.iter().zip(seqs) {
                host.extend([first, s.num_rows as u32, g.slot as u32, u32::from(!g.verify)]);
                first += s.num_rows as u32;
            }
            // Padded graph sequences step the spare slot.
            for _ in batch.seqs.len()..plan.layout.seqs {
                host.extend([first, graph_rows as u32, spare_slot, 1]);
                first += graph_rows as u32;
            }
        };
        // Padded graph sequences step the spare slot with the key's rows each, so only uniform steps replay graphs.
        let (model, tile_rows) = (&self.cfg.base, self.tile_rows());
        let step = Step { batch, model, model_id: self.id, tile_rows, mixed_graphs: false };
        cache.run_step(&self.dev, step, readout, runs, |cache, plan, runs_at, argmax| {
            self.record_step(cache, plan, runs_at, argmax)
        })
    }

    fn check(&self, batch: &ForwardBatch, cache: &CudaHybridCache, seqs: &[GdnSeq]) -> Result<()> {
        let bad = |m: String| Err(CudaModelError::Batch(m));
        if !cache.extra.pending.is_empty() {
            return bad("a verify awaits its rollback".into());
        }
        if seqs.len() != batch.seqs.len() {
            return bad(format!("{} state slots for {} sequences", seqs.len(), batch.seqs.len()));
        }
        let mut seen = vec![false; cache.extra.slots];
        for g in seqs {
            if g.slot >= cache.extra.slots || std::mem::replace(&mut seen[g.slot], true) {
                return bad(format!("state slot {} out of {} or repeated", g.slot, cache.extra.slots));
            }
        }
        Ok(())
    }

    fn linear(&self) -> Linear<'_> {
        Linear { dev: &self.dev, eps: self.cfg.base.rms_norm_eps }
    }

    /// Queues one step's kernels: embedding, the layers, the final norm and LM head, and with `argmax`
    /// the greedy ids.
    fn record_step(&self, cache: &CudaHybridCache, plan: &StepPlan, runs_at: usize, argmax: bool) -> Result<()> {
        let (b, ws, lay) = (&self.cfg.base, &cache.ws, &plan.layout);
        let (t, h) = (lay.t, b.hidden_size);
        let inputs = ws.inputs.view();
        let residual = ws.residual.view().prefix(t * h)?;
        let tokens = inputs.sub(lay.tokens().start, t)?;
        match &self.embed.w {
            DevWeight::Bf16(table) => gpu::embedding_bf16(&self.dev, table, tokens, residual)?,
            DevWeight::F32(table) => gpu::embedding_f32(&self.dev, table, tokens, residual)?,
            DevWeight::Quant(table) => embedding_quant(&self.dev, table, tokens, residual)?,
        }
        let runs = GdnRuns { runs: inputs.sub(runs_at, 4 * lay.seqs)?, rows: t };
        match &self.streams {
            None => self.plain_layers(cache, plan, runs)?,
            Some(streams) => self.stream_layers(cache, plan, runs, streams)?,
        }
        let l = lay.l;
        let logits_in = ws.logits_in.view().prefix(l * h)?;
        let rows = inputs.sub(lay.logit_rows().start, l)?;
        gather_rms_norm(&self.dev, residual, rows, &self.final_norm, b.rms_norm_eps, logits_in)?;
        let logits = ws.logits.view().prefix(l * b.vocab_size)?;
        let out = MatOut::Store { y: logits, ld: b.vocab_size, col: 0 };
        self.linear().matmul(ws, l, MatIn::Plain(logits_in), self.lm_head(), out)?;
        if argmax {
            gpu::argmax_rows(&self.dev, logits, b.vocab_size, ws.ids.view().prefix(l)?, &ws.argmax)?;
        }
        Ok(())
    }

    /// The layers over one residual stream, each block adding to `residual`.
    fn plain_layers(&self, cache: &CudaHybridCache, plan: &StepPlan, runs: GdnRuns) -> Result<()> {
        let (ws, t, h) = (&cache.ws, plan.layout.t, self.cfg.base.hidden_size);
        let residual = ws.residual.view().prefix(t * h)?;
        let out = BlockOut { y: residual, add: true };
        let width = self.capture_width();
        for (i, layer) in self.layers.iter().enumerate() {
            self.mixer_block(cache, plan, runs, layer, out)?;
            self.ffn_block(cache, t, layer, out)?;
            if let Some(tap) = self.capture_layers.iter().position(|&l| l == i) {
                copy_columns(&self.dev, residual, h, ws.captured.view().prefix(t * width)?, width, tap * h)?;
            }
        }
        Ok(())
    }

    /// The layers over hyper-connection streams: each block enters through its connection (its input collapsed
    /// into `residual`), writes its output to `delta` and leaves by mixing it back; the head's collapse ends in
    /// `residual` for the final norm.
    fn stream_layers(
        &self,
        cache: &CudaHybridCache,
        plan: &StepPlan,
        runs: GdnRuns,
        streams: &DevStreams,
    ) -> Result<()> {
        let (ws, t, h) = (&cache.ws, plan.layout.t, self.cfg.base.hidden_size);
        let out = BlockOut { y: ws.delta.view().prefix(t * h)?, add: false };
        let width = self.capture_width();
        streams.enter_model(&self.dev, ws, t, self.layers.len())?;
        for (i, layer) in self.layers.iter().enumerate() {
            self.mixer_block(cache, plan, runs, layer, out)?;
            streams.leave(&self.dev, ws, t, None, Next::Block(i, Block::Ffn))?;
            self.ffn_block(cache, t, layer, out)?;
            let tap = self.capture_layers.iter().position(|&l| l == i).map(|index| Tap { index, width });
            streams.leave(&self.dev, ws, t, tap, Next::after_layer(i, self.layers.len()))?;
        }
        Ok(())
    }

    /// A layer's token mixer on `residual` (normed by the layer's input norm) into `out`.
    fn mixer_block(
        &self,
        cache: &CudaHybridCache,
        plan: &StepPlan,
        runs: GdnRuns,
        layer: &DevHybridLayer,
        out: BlockOut,
    ) -> Result<()> {
        let (t, h) = (plan.layout.t, self.cfg.base.hidden_size);
        let residual = cache.ws.residual.view().prefix(t * h)?;
        let normed = MatIn::Normed { x: residual, w: layer.attn_norm.view() };
        match &layer.mixer {
            DevMixer::Attention(slot, a) => self.attention(cache, plan, *slot, a, normed, out.mat(h)),
            DevMixer::Gdn(slot, g) => self.gdn(cache, t, *slot, g, normed, runs, out.mat(h)),
        }
    }

    /// A layer's feed-forward block on `residual` (normed by the layer's post-attention norm) into `out`.
    fn ffn_block(&self, cache: &CudaHybridCache, t: usize, layer: &DevHybridLayer, out: BlockOut) -> Result<()> {
        let (ws, h) = (&cache.ws, self.cfg.base.hidden_size);
        let residual = ws.residual.view().prefix(t * h)?;
        match &layer.ffn {
            DevFfn::Dense { gate_up, down } => {
                let act = ws.act.view().prefix(t * down.k)?;
                let normed = MatIn::Normed { x: residual, w: layer.ffn_norm.view() };
                self.linear().matmul(ws, t, normed, gate_up, MatOut::Swiglu(act))?;
                self.linear().matmul(ws, t, MatIn::Plain(act), down, out.mat(h))
            }
            // The experts' weighted sum accumulates into its output: the residual, or `delta`, which the streams'
            // exit before this block left zeroed.
            DevFfn::Sparse(m) => self.moe(cache, t, m, layer.ffn_norm.view(), out.y),
        }
    }

    /// A (gated) attention layer: projection, q/k norm + RoPE + KV write, attention, the output gate, o_proj
    /// into `out`.
    fn attention(
        &self,
        cache: &CudaHybridCache,
        p: &StepPlan,
        slot: usize,
        a: &DevAttention,
        normed: MatIn,
        out: MatOut,
    ) -> Result<()> {
        let (b, ws, t) = (&self.cfg.base, &cache.ws, p.layout.t);
        let hd = b.head_dim;
        let (qd, kd) = (b.num_heads * hd, b.num_kv_heads * hd);
        let w = a.qkv.n;
        let qkv = ws.qkv.view().prefix(t * w)?;
        self.linear().matmul(ws, t, normed, &a.qkv, MatOut::Store { y: qkv, ld: w, col: 0 })?;
        let norms = (a.q_norm.as_ref().map(|n| n.view()), a.k_norm.as_ref().map(|n| n.view()));
        let attn = attend(&self.dev, cache, p, slot, (qkv, w), &self.rope, norms, b)?;
        if a.gated {
            sigmoid_gate_mul(&self.dev, attn, qd, qkv.sub(qd + 2 * kd, t * w - qd - 2 * kd)?, w)?;
        }
        self.linear().matmul(ws, t, MatIn::Plain(attn), &a.o_proj, out)
    }

    /// A Gated DeltaNet layer (GDN layer `g`): projection into the layer's own buffer (kept for a
    /// rollback), conv, rule inputs, the recurrent rule, the gated norm, out_proj into `out`.
    #[allow(clippy::too_many_arguments)]
    fn gdn(
        &self,
        cache: &CudaHybridCache,
        t: usize,
        g: usize,
        w: &DevGdn,
        normed: MatIn,
        runs: GdnRuns,
        out: MatOut,
    ) -> Result<()> {
        let d = self.gdn_dims()?;
        let (sz, hy, ws) = (cache.extra.gdn, &cache.extra.hy, &cache.ws);
        let t_cap = cache.cfg.max_tokens;
        let (c, vd, hv) = (d.conv_dim(), d.value_dim(), d.num_v_heads);
        let proj = hy.proj.view().sub(g * t_cap * sz.proj, t * sz.proj)?;
        let conv_out = hy.conv_out.view().sub(g * t_cap * c, t * c)?;
        let gb = hy.gb.view().sub(g * t_cap * sz.gb, t * sz.gb)?;
        let core = hy.core.view().prefix(t * vd)?;
        self.linear().matmul(ws, t, normed, &w.in_proj, MatOut::Store { y: proj, ld: sz.proj, col: 0 })?;
        let slot_view = |buf, per| layer_state(buf, g, per, sz.layers, cache.extra.slots + 1);
        let conv_state = slot_view(hy.conv_state.view(), sz.conv_state)?;
        let conv = GdnConvArgs {
            x: proj,
            x_ld: sz.proj,
            x_layer: 0,
            w: Some(w.conv_w.view()),
            state: conv_state,
            runs,
            layers: 1,
            channels: c,
            kernel: d.conv_kernel,
            out: Some(conv_out),
        };
        gdn_conv(&self.dev, conv)?;
        let ba = proj.sub(c + vd, t * sz.proj - c - vd)?;
        let prep = GdnPrepArgs {
            qkv: conv_out,
            channels: c,
            k_heads: d.num_k_heads,
            k_head_dim: d.k_head_dim,
            ba,
            ba_ld: sz.proj,
            neg_a: w.neg_a.view(),
            dt_bias: w.dt_bias.view(),
            gb,
            rows: t,
        };
        gdn_prep(&self.dev, prep)?;
        let rule = GdnRuleArgs {
            qkv: conv_out,
            channels: c,
            qkv_layer: 0,
            gb,
            gb_layer: 0,
            state: slot_view(hy.ssm.view(), sz.ssm)?,
            runs,
            layers: 1,
            k_heads: d.num_k_heads,
            v_heads: hv,
            k_head_dim: d.k_head_dim,
            v_head_dim: d.v_head_dim,
            out: Some(core),
        };
        gdn_rule(&self.dev, rule)?;
        gdn_gated_norm(
            &self.dev,
            core,
            proj.sub(c, t * sz.proj - c)?,
            sz.proj,
            &w.norm,
            hv,
            self.cfg.base.rms_norm_eps,
        )?;
        self.linear().matmul(ws, t, MatIn::Plain(core), &w.out_proj, out)
    }

    /// A sparse MoE block: the pre-norm once, the router (and shared gate) logits, the shared expert, then
    /// routing, the routed experts and the weighted sum added to `y` (`[t, hidden]`).
    fn moe(
        &self,
        cache: &CudaHybridCache,
        t: usize,
        m: &DevMoe,
        norm: DevSlice<'_, f32>,
        y: DevSlice<'_, f32>,
    ) -> Result<()> {
        let (b, ws, hy) = (&self.cfg.base, &cache.ws, &cache.extra.hy);
        let dims = self.cfg.moe.ok_or_else(|| CudaModelError::Unsupported("a sparse layer without MoE dims".into()))?;
        let h = b.hidden_size;
        let (residual, normed) = (ws.residual.view().prefix(t * h)?, ws.normed.view().prefix(t * h)?);
        gpu::rms_norm(&self.dev, residual, norm, b.rms_norm_eps, normed)?;
        let lw = m.router.n;
        let logits = hy.router.view().prefix(t * lw)?;
        self.linear().matmul(ws, t, MatIn::Plain(normed), &m.router, MatOut::Store { y: logits, ld: lw, col: 0 })?;
        let shared = match &m.shared {
            Some((gate_up, down)) => {
                let act = ws.act.view().prefix(t * down.k)?;
                let y = hy.shared_y.view().prefix(t * h)?;
                self.linear().matmul(ws, t, MatIn::Plain(normed), gate_up, MatOut::Swiglu(act))?;
                self.linear().matmul(ws, t, MatIn::Plain(act), down, MatOut::Store { y, ld: h, col: 0 })?;
                Some(y)
            }
            None => None,
        };
        let scratch = hy.moe.as_ref().ok_or_else(|| CudaModelError::Unsupported("no MoE scratch".into()))?;
        let args = MoeArgs {
            x: normed,
            logits,
            logit_ld: lw,
            experts: m.experts.view(),
            num_experts: dims.num_experts,
            top_k: dims.top_k,
            norm_topk: dims.norm_topk_prob,
            hidden: h,
            inter: dims.expert_intermediate,
            shared,
            residual: y,
        };
        Ok(moe_forward(&self.dev, args, scratch)?)
    }
}

/// Where a layer's blocks put their outputs: added to the residual (`add`), or stored in `delta` for the streams.
#[derive(Clone, Copy)]
struct BlockOut<'a> {
    y: DevSlice<'a, f32>,
    add: bool,
}

impl<'a> BlockOut<'a> {
    fn mat(self, hidden: usize) -> MatOut<'a> {
        match self.add {
            true => MatOut::Add { y: self.y, sum_sq: None },
            false => MatOut::Store { y: self.y, ld: hidden, col: 0 },
        }
    }
}

/// GDN layer `g`'s state in a buffer of `[slots, layers, per]` floats, as a one-layer view.
fn layer_state(buf: DevSlice<'_, f32>, g: usize, per: usize, layers: usize, slots: usize) -> Result<GdnStateView<'_>> {
    let state = buf.sub(g * per, buf.len() - g * per)?;
    Ok(GdnStateView { state, layer_stride: 0, slot_stride: layers * per, slots })
}

/// Records the step's verifying sequences (row range and slot) for [`CudaHybridModel::rollback`], once the step's
/// results are safely back: a step that failed leaves no verify pending (its sequences kept their state).
fn set_pending(batch: &ForwardBatch, cache: &mut CudaHybridCache, seqs: &[GdnSeq]) {
    let mut start = 0u32;
    cache.extra.pending.clear();
    for (s, g) in batch.seqs.iter().zip(seqs) {
        if g.verify {
            cache.extra.pending.push([start, s.num_rows as u32, g.slot as u32]);
        }
        start += s.num_rows as u32;
    }
}
