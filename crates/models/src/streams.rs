//! Hyper-connection residual streams (mHC, as transformers' `DeepseekV4HyperConnection` / `DeepseekV4HyperHead`).
//!
//! A stream target keeps its residual as `N` parallel streams per token, `[T, N · H]` stream-major. Every block
//! (token mixer, feed-forward) enters through a `HyperConnection`: from the RMS-normalised flat streams it
//! computes `pre`, `post` and `comb` weights, collapses the streams to the block's input `Σₙ preₙ · Sₙ`, and on the
//! way out writes `S'ₖ = postₖ · out + Σⱼ comb[j, k] · Sⱼ` (`comb` made doubly stochastic by Sinkhorn iterations).
//! The embedding enters as `N` copies; the `StreamHead` collapses the last layer's streams before the final norm.
//! Every row depends on its own row only, so batching and speculation never change a row's bits.
//!
//! Drafters read a tap as the per-token mean of its streams, the raw streams, or the head's collapse
//! ([`StreamTap`]). Design notes: docs/MODELS.md, "Hyper-connection streams".

use dflash_runtime::ops;
use dflash_runtime::{DType, Tensor};
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::weights::WeightStore;

/// A checkpoint's stream settings (`hc_mult`, `hc_sinkhorn_iters`, `hc_eps` in `config.json`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamConfig {
    /// Streams per token (`hc_mult`).
    pub count: usize,
    /// Sinkhorn normalisations of the residual mix (`hc_sinkhorn_iters`).
    pub sinkhorn_iters: usize,
    /// Added to the weights and the Sinkhorn sums (`hc_eps`).
    pub eps: f32,
}

impl StreamConfig {
    /// The settings of a config that has `hc_mult`; `None` for a plain residual. Defaults are transformers'.
    ///
    /// # Errors
    /// `Config` for a malformed or zero `hc_mult` or `hc_sinkhorn_iters`.
    pub fn from_hf(v: &Value) -> Result<Option<Self>> {
        let Some(mult) = v.get("hc_mult").filter(|m| !m.is_null()) else { return Ok(None) };
        let positive = |key: &str, x: Option<&Value>, default: u64| -> Result<usize> {
            match x.filter(|x| !x.is_null()).map(Value::as_u64) {
                None => Ok(default as usize),
                Some(Some(n)) if n > 0 => Ok(n as usize),
                Some(_) => Err(ModelError::Config(format!("config.json: `{key}` must be a positive integer"))),
            }
        };
        let cfg = StreamConfig {
            count: positive("hc_mult", Some(mult), 4)?,
            sinkhorn_iters: positive("hc_sinkhorn_iters", v.get("hc_sinkhorn_iters"), 20)?,
            eps: v.get("hc_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
        };
        Ok(Some(cfg))
    }

    /// Outputs of a connection's projection: `pre` and `post` (`N` each) and `comb` (`N × N`).
    fn mix_width(&self) -> usize {
        (2 + self.count) * self.count
    }
}

/// What a drafter reads at a tapped layer of a stream target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamTap {
    /// The per-token mean of the streams, `hidden` values (DFlash drafters trained on pooled streams).
    #[default]
    Mean,
    /// Every stream as it is, `streams × hidden` values, stream-major (a drafter built for the raw stream).
    Raw,
    /// The head's collapse of the last layer's streams, the state the final norm reads (the MTP head). Only the
    /// last layer may be tapped.
    Head,
}

impl StreamTap {
    /// Values one tap takes in a captured row.
    pub fn width(self, streams: usize, hidden: usize) -> usize {
        match self {
            StreamTap::Raw => streams * hidden,
            StreamTap::Mean | StreamTap::Head => hidden,
        }
    }
}

/// One block's hyper-connection (`attn_hc` or `ffn_hc` of a layer).
#[derive(Debug)]
pub(crate) struct HyperConnection {
    proj: Tensor,    // [(2 + N) · N, N · H] f32
    base: Vec<f32>,  // [(2 + N) · N]
    scale: [f32; 3], // pre, post, comb
}

/// A layer's two connections.
#[derive(Debug)]
pub(crate) struct LayerStreams {
    pub(crate) attn: HyperConnection,
    pub(crate) ffn: HyperConnection,
}

impl LayerStreams {
    /// Takes `{prefix}.attn_hc.*` and `{prefix}.ffn_hc.*` (`prefix` = `model.layers.{i}`).
    ///
    /// # Errors
    /// Missing or misshapen tensors, named.
    pub(crate) fn load(store: &mut WeightStore, prefix: &str, cfg: &StreamConfig, hidden: usize) -> Result<Self> {
        Ok(LayerStreams {
            attn: HyperConnection::load(store, &format!("{prefix}.attn_hc"), cfg, hidden)?,
            ffn: HyperConnection::load(store, &format!("{prefix}.ffn_hc"), cfg, hidden)?,
        })
    }

    /// Bytes of the connections' weights.
    pub(crate) fn weight_bytes(&self) -> usize {
        self.attn.proj.byte_len() + self.ffn.proj.byte_len()
    }
}

impl HyperConnection {
    /// The weights as uploaded: projection `[(2 + N) · N, N · H]`, base, the three scales.
    #[cfg(feature = "cuda")]
    pub(crate) fn parts(&self) -> (&Tensor, &[f32], &[f32]) {
        (&self.proj, &self.base, &self.scale)
    }

    fn load(store: &mut WeightStore, prefix: &str, cfg: &StreamConfig, hidden: usize) -> Result<Self> {
        let (m, n) = (cfg.mix_width(), cfg.count);
        let proj = f32_tensor(store.take(&format!("{prefix}.fn"), &[m, n * hidden])?)?;
        let base = f32_values(store.take(&format!("{prefix}.base"), &[m])?)?;
        let scale = f32_values(store.take(&format!("{prefix}.scale"), &[3])?)?;
        Ok(HyperConnection { proj, base, scale: [scale[0], scale[1], scale[2]] })
    }
}

/// The final collapse (`model.hc_head`): `Σₙ preₙ · Sₙ` with its own `pre` weights.
#[derive(Debug)]
pub(crate) struct StreamHead {
    proj: Tensor,   // [N, N · H] f32
    base: Vec<f32>, // [N]
    scale: f32,
}

impl StreamHead {
    /// The weights as uploaded: projection `[N, N · H]`, base, the scale.
    #[cfg(feature = "cuda")]
    pub(crate) fn parts(&self) -> (&Tensor, &[f32], f32) {
        (&self.proj, &self.base, self.scale)
    }

    /// Takes `model.hc_head.{hc_fn, hc_base, hc_scale}`.
    ///
    /// # Errors
    /// Missing or misshapen tensors, named.
    pub(crate) fn load(store: &mut WeightStore, cfg: &StreamConfig, hidden: usize) -> Result<Self> {
        let n = cfg.count;
        let proj = f32_tensor(store.take("model.hc_head.hc_fn", &[n, n * hidden])?)?;
        let base = f32_values(store.take("model.hc_head.hc_base", &[n])?)?;
        let scale = f32_values(store.take("model.hc_head.hc_scale", &[1])?)?[0];
        Ok(StreamHead { proj, base, scale })
    }
}

/// Everything a stream target adds to its family's weights: each layer's connections, the head, and how taps
/// read the streams.
#[derive(Debug)]
pub(crate) struct ModelStreams {
    pub(crate) cfg: StreamConfig,
    pub(crate) layers: Vec<LayerStreams>,
    pub(crate) head: StreamHead,
    pub(crate) tap: StreamTap,
}

impl ModelStreams {
    /// Takes every layer's connections and the head; `None` for a config without streams.
    ///
    /// # Errors
    /// Missing or misshapen tensors (named); a [`StreamTap::Head`] tap on a layer other than the last.
    pub(crate) fn load(
        store: &mut WeightStore,
        cfg: Option<StreamConfig>,
        num_layers: usize,
        hidden: usize,
        capture_layers: &[usize],
        tap: StreamTap,
    ) -> Result<Option<Self>> {
        let Some(cfg) = cfg else { return Ok(None) };
        if let Some(&l) = capture_layers.iter().find(|&&l| tap == StreamTap::Head && l + 1 != num_layers) {
            return Err(ModelError::Config(format!(
                "layer {l} is tapped for the head's collapse, which only the last layer ({}) has",
                num_layers - 1
            )));
        }
        let layers = (0..num_layers)
            .map(|i| LayerStreams::load(store, &format!("model.layers.{i}"), &cfg, hidden))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(ModelStreams { cfg, layers, head: StreamHead::load(store, &cfg, hidden)?, tap }))
    }

    /// Values of one captured row for `taps` taps.
    pub(crate) fn capture_width(&self, taps: usize, hidden: usize) -> usize {
        taps * self.tap.width(self.cfg.count, hidden)
    }

    /// Bytes of the connections' and the head's weights (read by every decode step).
    pub(crate) fn weight_bytes(&self) -> usize {
        self.layers.iter().map(LayerStreams::weight_bytes).sum::<usize>() + self.head.proj.byte_len()
    }
}

/// The residual of a stream target's forward, with the mixing weights of the block it is in.
pub(crate) struct StreamResidual {
    cfg: StreamConfig,
    hidden: usize,
    norm_eps: f32,
    streams: Tensor, // [T, N · H]
    flat: Tensor,    // [T, N · H]: the streams RMS-normalised as one row (the projection's input)
    mixes: Tensor,   // [T, (2 + N) · N]: the projection's output
    post: Vec<f32>,  // [T, N]
    comb: Vec<f32>,  // [T, N, N]: comb[t, j, k] carries stream j into output stream k
}

impl StreamResidual {
    /// `N` copies of every embedded row. `norm_eps` is the model's `rms_norm_eps` (the connections' input norm).
    ///
    /// # Errors
    /// Allocation or shape failures.
    pub(crate) fn from_embedding(
        embedded: &Tensor, /* [T, H] */
        cfg: StreamConfig,
        norm_eps: f32,
    ) -> Result<Self> {
        let (t, h, n) = (embedded.rows(), embedded.row_len(), cfg.count);
        let mut streams = Tensor::zeros(DType::F32, &[t, n * h])?;
        let src = embedded.as_f32()?;
        for (row, out) in src.chunks_exact(h).zip(streams.as_f32_mut()?.chunks_exact_mut(n * h)) {
            out.chunks_exact_mut(h).for_each(|s| s.copy_from_slice(row));
        }
        Ok(StreamResidual {
            cfg,
            hidden: h,
            norm_eps,
            flat: Tensor::zeros(DType::F32, &[t, n * h])?,
            mixes: Tensor::zeros(DType::F32, &[t, cfg.mix_width()])?,
            post: vec![0.0; t * n],
            comb: vec![0.0; t * n * n],
            streams,
        })
    }

    /// Enters a block through `hc`: keeps its `post` / `comb` for [`Self::leave`] and writes the block's input,
    /// the collapsed streams, to `collapsed` (`[T, H]`).
    ///
    /// # Errors
    /// Shape failures.
    pub(crate) fn enter(&mut self, hc: &HyperConnection, collapsed: &mut Tensor) -> Result<()> {
        self.project(&hc.proj)?;
        let (n, h, eps) = (self.cfg.count, self.hidden, self.cfg.eps);
        let [pre_s, post_s, comb_s] = hc.scale;
        let (pre_b, rest) = hc.base.split_at(n);
        let (post_b, comb_b) = rest.split_at(n);
        let mixes = self.mixes.as_f32()?;
        let streams = self.streams.as_f32()?;
        let out = collapsed.as_f32_mut()?;
        let rows = mixes.chunks_exact(self.cfg.mix_width()).zip(streams.chunks_exact(n * h));
        let mut pre = vec![0f32; n];
        for (t, ((m, s), x)) in rows.zip(out.chunks_exact_mut(h)).enumerate() {
            for k in 0..n {
                pre[k] = sigmoid(m[k] * pre_s + pre_b[k]) + eps;
                self.post[t * n + k] = 2.0 * sigmoid(m[n + k] * post_s + post_b[k]);
            }
            let comb = &mut self.comb[t * n * n..(t + 1) * n * n];
            for (c, (&w, &b)) in comb.iter_mut().zip(m[2 * n..].iter().zip(comb_b)) {
                *c = w * comb_s + b;
            }
            sinkhorn(comb, n, self.cfg.sinkhorn_iters, eps);
            weighted_sum(&pre, s, x);
        }
        Ok(())
    }

    /// Leaves the block: `S'ₖ = postₖ · out + Σⱼ comb[j, k] · Sⱼ` for every row (`out`: `[T, H]`).
    ///
    /// # Errors
    /// Shape failures.
    pub(crate) fn leave(&mut self, out: &Tensor) -> Result<()> {
        let (n, h) = (self.cfg.count, self.hidden);
        let out = out.as_f32()?;
        let mut mixed = vec![0f32; n * h];
        let streams = self.streams.as_f32_mut()?;
        for (t, (s, o)) in streams.chunks_exact_mut(n * h).zip(out.chunks_exact(h)).enumerate() {
            let (post, comb) = (&self.post[t * n..(t + 1) * n], &self.comb[t * n * n..(t + 1) * n * n]);
            for (k, dst) in mixed.chunks_exact_mut(h).enumerate() {
                for (d, &x) in dst.iter_mut().zip(o) {
                    *d = post[k] * x;
                }
                for (j, src) in s.chunks_exact(h).enumerate() {
                    let c = comb[j * n + k];
                    dst.iter_mut().zip(src).for_each(|(d, &x)| *d += c * x);
                }
            }
            s.copy_from_slice(&mixed);
        }
        Ok(())
    }

    /// The head's collapse of every row (`out`: `[T, H]`), the final norm's input.
    ///
    /// # Errors
    /// Shape failures.
    pub(crate) fn collapse_with(&mut self, head: &StreamHead, out: &mut Tensor) -> Result<()> {
        let n = self.cfg.count;
        let mut mixes = Tensor::zeros(DType::F32, &[self.streams.rows(), n])?;
        self.normalise_flat()?;
        ops::matmul(&self.flat, &head.proj, &mut mixes)?;
        let mut pre = vec![0f32; n];
        let rows = mixes.as_f32()?.chunks_exact(n).zip(self.streams.as_f32()?.chunks_exact(n * self.hidden));
        for ((m, s), x) in rows.zip(out.as_f32_mut()?.chunks_exact_mut(self.hidden)) {
            for k in 0..n {
                pre[k] = sigmoid(m[k] * head.scale + head.base[k]) + self.cfg.eps;
            }
            weighted_sum(&pre, s, x);
        }
        Ok(())
    }

    /// Writes tap `tap` of every row into `captured` (`[T, taps × width]`) as `mode` reads it.
    ///
    /// # Errors
    /// Shape failures.
    pub(crate) fn write_tap(
        &mut self,
        mode: StreamTap,
        head: &StreamHead,
        captured: &mut Tensor,
        tap: usize,
    ) -> Result<()> {
        let (n, h) = (self.cfg.count, self.hidden);
        let width = mode.width(n, h);
        let row_len = captured.row_len();
        match mode {
            StreamTap::Raw => copy_into(self.streams.as_f32()?, n * h, captured.as_f32_mut()?, row_len, tap * width),
            StreamTap::Mean => {
                let inv = 1.0 / n as f32;
                let dst = captured.as_f32_mut()?;
                for (s, d) in self.streams.as_f32()?.chunks_exact(n * h).zip(dst.chunks_exact_mut(row_len)) {
                    let d = &mut d[tap * width..(tap + 1) * width];
                    d.copy_from_slice(&s[..h]);
                    for stream in s.chunks_exact(h).skip(1) {
                        d.iter_mut().zip(stream).for_each(|(o, &x)| *o += x);
                    }
                    d.iter_mut().for_each(|o| *o *= inv);
                }
            }
            StreamTap::Head => {
                let mut collapsed = Tensor::zeros(DType::F32, &[self.streams.rows(), h])?;
                self.collapse_with(head, &mut collapsed)?;
                copy_into(collapsed.as_f32()?, h, captured.as_f32_mut()?, row_len, tap * width);
            }
        }
        Ok(())
    }

    /// `mixes = rms(streams) · projᵀ` row by row.
    fn project(&mut self, proj: &Tensor) -> Result<()> {
        self.normalise_flat()?;
        Ok(ops::matmul(&self.flat, proj, &mut self.mixes)?)
    }

    /// `flat = streams / sqrt(mean(streams²) + eps)` over each whole row (the connections' unweighted norm).
    fn normalise_flat(&mut self) -> Result<()> {
        let w = self.cfg.count * self.hidden;
        let eps = self.norm_eps;
        let src = self.streams.as_f32()?;
        for (s, f) in src.chunks_exact(w).zip(self.flat.as_f32_mut()?.chunks_exact_mut(w)) {
            let mean_sq = s.iter().map(|&x| x * x).sum::<f32>() / w as f32;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            f.iter_mut().zip(s).for_each(|(o, &x)| *o = x * inv);
        }
        Ok(())
    }
}

/// Softmax over each row `j` of `comb` (`[N, N]`), `+ eps`, then Sinkhorn: columns, then `iters - 1` times rows
/// and columns, each divided by its sum `+ eps` (transformers' order).
fn sinkhorn(comb: &mut [f32], n: usize, iters: usize, eps: f32) {
    for row in comb.chunks_exact_mut(n) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter_mut().for_each(|x| *x = (*x - max).exp());
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|x| *x = *x / sum + eps);
    }
    normalise_columns(comb, n, eps);
    for _ in 1..iters {
        for row in comb.chunks_exact_mut(n) {
            let sum = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|x| *x /= sum);
        }
        normalise_columns(comb, n, eps);
    }
}

fn normalise_columns(comb: &mut [f32], n: usize, eps: f32) {
    for k in 0..n {
        let sum = (0..n).map(|j| comb[j * n + k]).sum::<f32>() + eps;
        (0..n).for_each(|j| comb[j * n + k] /= sum);
    }
}

/// `out = Σₙ weights[n] · streams[n]` (`streams`: `[N, H]` flat).
fn weighted_sum(weights: &[f32], streams: &[f32], out: &mut [f32]) {
    let h = out.len();
    out.fill(0.0);
    for (&w, s) in weights.iter().zip(streams.chunks_exact(h)) {
        out.iter_mut().zip(s).for_each(|(o, &x)| *o += w * x);
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Copies every `w`-wide row of `src` into columns `col..col + w` of `dst` (rows of `dst_row`).
fn copy_into(src: &[f32], w: usize, dst: &mut [f32], dst_row: usize, col: usize) {
    for (s, d) in src.chunks_exact(w).zip(dst.chunks_exact_mut(dst_row)) {
        d[col..col + w].copy_from_slice(s);
    }
}

fn f32_tensor(t: Tensor) -> Result<Tensor> {
    Ok(if t.dtype() == DType::F32 { t } else { t.to_f32()? })
}

fn f32_values(t: Tensor) -> Result<Vec<f32>> {
    Ok(f32_tensor(t)?.as_f32()?.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_config_keys_and_transformers_defaults() {
        let v = serde_json::json!({"hc_mult": 4});
        let c = StreamConfig::from_hf(&v).expect("config").expect("streams");
        assert_eq!((c.count, c.sinkhorn_iters, c.eps), (4, 20, 1e-6));
        assert!(StreamConfig::from_hf(&serde_json::json!({})).expect("none").is_none());
        assert!(StreamConfig::from_hf(&serde_json::json!({"hc_mult": 0})).is_err());
    }

    #[test]
    fn sinkhorn_gives_a_doubly_stochastic_mix() {
        let mut comb = vec![0.3, -1.0, 2.0, 0.5, 0.1, -0.7, 1.5, 0.0, 0.2];
        sinkhorn(&mut comb, 3, 20, 1e-6);
        for i in 0..3 {
            let row: f32 = comb[i * 3..i * 3 + 3].iter().sum();
            let col: f32 = (0..3).map(|j| comb[j * 3 + i]).sum();
            assert!((row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5, "row {row} col {col}");
        }
    }

    /// transformers' `DeepseekV4HyperConnection` and `DeepseekV4HyperHead` on random weights and streams
    /// (tools/golden/stream_fixtures.py, `hc_module.*`).
    #[test]
    fn connection_and_head_match_transformers() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-qwen3-next-hc/golden.safetensors");
        let bytes = std::fs::read(path).expect("golden file");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("golden parses");
        let get = |name: &str| -> Vec<f32> {
            let view = st.tensor(&format!("hc_module.{name}")).expect(name);
            view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let cfg = StreamConfig { count: 4, sinkhorn_iters: 20, eps: 1e-4 };
        let (t, n, h) = (5, 4, 32);
        let hc = HyperConnection {
            proj: Tensor::from_f32(&get("fn"), &[24, n * h]).expect("fn"),
            base: get("base"),
            scale: get("scale").try_into().expect("three scales"),
        };
        let head = StreamHead {
            proj: Tensor::from_f32(&get("head_fn"), &[n, n * h]).expect("head fn"),
            base: get("head_base"),
            scale: get("head_scale")[0],
        };
        let embedded = Tensor::zeros(DType::F32, &[t, h]).expect("rows");
        let mut res = StreamResidual::from_embedding(&embedded, cfg, 1e-6).expect("residual");
        res.streams.as_f32_mut().expect("streams").copy_from_slice(&get("streams"));
        let mut collapsed = Tensor::zeros(DType::F32, &[t, h]).expect("collapsed");
        res.enter(&hc, &mut collapsed).expect("enter");
        let close = |what: &str, got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}[{i}]: {g} vs {w}");
            }
        };
        close("post", &res.post, &get("post"));
        close("comb", &res.comb, &get("comb"));
        close("collapsed", collapsed.as_f32().expect("f32"), &get("collapsed"));
        let mut head_out = Tensor::zeros(DType::F32, &[t, h]).expect("head out");
        res.collapse_with(&head, &mut head_out).expect("head");
        close("head", head_out.as_f32().expect("f32"), &get("head_out"));
        res.leave(&Tensor::from_f32(&get("block_out"), &[t, h]).expect("block out")).expect("leave");
        close("expanded", res.streams.as_f32().expect("f32"), &get("expanded"));
    }
}

/// The CUDA kernels (`streams.cu`) against this module on random streams and weights, and a row alone against the
/// same row in a batch (bit for bit: batch invariance). Skips without a device.
#[cfg(all(test, feature = "cuda"))]
mod cuda_twins {
    use dflash_runtime::cuda::ops::{
        streams_broadcast, streams_collapse, streams_expand, streams_head, streams_mean, StreamConnection, StreamDims,
        StreamMix,
    };
    use dflash_runtime::cuda::{CudaDevice, DeviceBuf};

    use super::*;

    const ROWS: usize = 5;

    fn values(n: usize, seed: u64, scale: f32, offset: f32) -> Vec<f32> {
        let mut z = seed;
        (0..n)
            .map(|_| {
                z = z.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                offset + scale * ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    }

    fn close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}[{i}]: {g} vs {w}");
        }
    }

    fn device() -> Option<CudaDevice> {
        match CudaDevice::new(0) {
            Ok(dev) => Some(dev),
            Err(e) if e.is_no_device() => {
                eprintln!("SKIP streams kernels: no CUDA device ({e})");
                None
            }
            Err(e) => panic!("CUDA device: {e}"),
        }
    }

    /// Four streams of 96 (the fixtures' regime), three of 320 (more than one column block of the expand, uneven
    /// strides) and the most the kernels take (8 of 64).
    #[test]
    fn kernels_match_the_cpu() {
        let Some(dev) = device() else { return };
        for (n, h) in [(4, 96), (3, 320), (8, 64)] {
            twin(&dev, n, h);
        }
    }

    /// A connection's scratch on the device for `rows` rows.
    struct Scratch {
        mixes: DeviceBuf<f32>,
        post: DeviceBuf<f32>,
        comb: DeviceBuf<f32>,
    }

    impl Scratch {
        fn new(dev: &CudaDevice, rows: usize, n: usize) -> Self {
            let zeros = |len: usize| dev.alloc_zeros(len).expect("scratch");
            Scratch { mixes: zeros(rows * (2 + n) * n), post: zeros(rows * n), comb: zeros(rows * n * n) }
        }

        fn mix(&self) -> StreamMix<'_> {
            StreamMix { mixes: self.mixes.view(), post: self.post.view(), comb: self.comb.view() }
        }
    }

    fn connection(m: usize, row: usize, seed: u64) -> HyperConnection {
        HyperConnection {
            proj: Tensor::from_f32(&values(m * row, seed, 0.1, 0.0), &[m, row]).expect("proj"),
            base: values(m, seed + 1, 0.5, 0.0),
            scale: [1.1, 0.7, 1.3],
        }
    }

    fn twin(dev: &CudaDevice, n: usize, h: usize) {
        let cfg = StreamConfig { count: n, sinkhorn_iters: 20, eps: 1e-4 };
        let m = cfg.mix_width();
        let hc = connection(m, n * h, 1);
        let head = StreamHead {
            proj: Tensor::from_f32(&values(n * n * h, 3, 0.1, 0.0), &[n, n * h]).expect("head"),
            base: values(n, 4, 0.5, 0.0),
            scale: 0.9,
        };
        let embedded = Tensor::from_f32(&values(ROWS * h, 5, 1.0, 0.0), &[ROWS, h]).expect("x");
        let block_out = Tensor::from_f32(&values(ROWS * h, 6, 1.0, 0.0), &[ROWS, h]).expect("out");
        // The CPU: one block through the connection, the head, the mean tap, on streams that differ (as after a
        // layer).
        let mut cpu = StreamResidual::from_embedding(&embedded, cfg, 1e-6).expect("residual");
        cpu.streams.as_f32_mut().expect("f32").copy_from_slice(&values(ROWS * n * h, 7, 1.0, 0.1));
        let start = cpu.streams.as_f32().expect("f32").to_vec();
        let mut collapsed = Tensor::zeros(DType::F32, &[ROWS, h]).expect("collapsed");
        cpu.enter(&hc, &mut collapsed).expect("enter");
        cpu.leave(&block_out).expect("leave");
        let mut head_out = Tensor::zeros(DType::F32, &[ROWS, h]).expect("head out");
        cpu.collapse_with(&head, &mut head_out).expect("head");
        let mut mean = Tensor::zeros(DType::F32, &[ROWS, 2 * h]).expect("mean");
        cpu.write_tap(StreamTap::Mean, &head, &mut mean, 1).expect("tap");

        let what = |s: &str| format!("{n} streams of {h}: {s}");
        let d = StreamDims { streams: n, hidden: h, sinkhorn_iters: 20, eps: 1e-4, norm_eps: 1e-6 };
        let up = |v: &[f32]| dev.upload(v).expect("upload");
        let zeros = |len: usize| up(&vec![0.0; len]);
        let (proj, base, scale) = (up(hc.proj.as_f32().expect("f32")), up(&hc.base), up(&hc.scale));
        let conn = StreamConnection { proj: proj.view(), base: base.view(), scale: scale.view() };
        let (hproj, hbase, hscale) = (up(head.proj.as_f32().expect("f32")), up(&head.base), up(&[head.scale]));
        let hconn = StreamConnection { proj: hproj.view(), base: hbase.view(), scale: hscale.view() };
        let streams = up(&start);
        let scratch = Scratch::new(dev, ROWS, n);
        let (mix, mixes, post, comb) = (scratch.mix(), &scratch.mixes, &scratch.post, &scratch.comb);
        let gpu_collapsed = zeros(ROWS * h);
        streams_collapse(dev, &d, &streams, &conn, &gpu_collapsed, &mix).expect("collapse");
        let collapsed_after_enter = dev.download(&gpu_collapsed).expect("download");
        close(&what("post"), &dev.download(post).expect("post"), &cpu.post);
        close(&what("comb"), &dev.download(comb).expect("comb"), &cpu.comb);
        close(&what("collapsed"), &collapsed_after_enter, collapsed.as_f32().expect("f32"));
        streams_expand(dev, &d, &streams, &up(block_out.as_f32().expect("f32")), &mix).expect("expand");
        close(&what("expanded"), &dev.download(&streams).expect("streams"), cpu.streams.as_f32().expect("f32"));
        let gpu_head = zeros(ROWS * h);
        streams_head(dev, &d, &streams, &hconn, mixes.view(), &gpu_head).expect("head");
        close(&what("head"), &dev.download(&gpu_head).expect("head"), head_out.as_f32().expect("f32"));
        let gpu_mean = zeros(ROWS * 2 * h);
        streams_mean(dev, &d, &streams, &gpu_mean, 2 * h, h).expect("mean");
        let got = dev.download(&gpu_mean).expect("mean");
        let column = |v: &[f32]| v.chunks_exact(2 * h).flat_map(|r| r[h..].to_vec()).collect::<Vec<f32>>();
        close(&what("mean tap"), &column(&got), &column(mean.as_f32().expect("f32")));
        let copies = zeros(ROWS * n * h);
        streams_broadcast(dev, &d, &up(embedded.as_f32().expect("f32")), &copies).expect("broadcast");
        let want: Vec<f32> = embedded.as_f32().expect("f32").chunks_exact(h).flat_map(|r| r.repeat(n)).collect();
        assert_eq!(dev.download(&copies).expect("copies"), want, "{}", what("N copies of each row"));

        // Row 3 alone gives the bits it got in the batch.
        let alone = up(&start[3 * n * h..4 * n * h]);
        let (scratch1, out1) = (Scratch::new(dev, 1, n), zeros(h));
        streams_collapse(dev, &d, &alone, &conn, &out1, &scratch1.mix()).expect("collapse alone");
        let got = dev.download(&out1).expect("alone");
        assert_eq!(
            got,
            collapsed_after_enter[3 * h..4 * h],
            "{}",
            what("a row's collapse does not depend on the batch")
        );
    }
}
