//! [`CudaLlamaModel`]: a Llama-family model (Llama, SmolLM2, Qwen3 dense) with its weights on one GPU.

use std::sync::Arc;

use dflash_runtime::cuda::ops::{fill_random_f32, QuantFormat, ATTN_MAX_QUERIES};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf, STREAMS_MAX};
use dflash_runtime::ops::RopeTable;
use dflash_runtime::Tensor;

use crate::checkpoint::LoadOptions;
use crate::config::{Architecture, ModelConfig};
use crate::cuda::{
    next_model_id, upload_norm, CudaCache, CudaCacheConfig, CudaModelError, DevMatrix, DevProjection, DevStreams,
    DevWeight, MatrixKind, Result, TileRows, WorkspaceShape,
};
use crate::llama::weights::{take_heads, take_layer, LayerTensors};
use crate::resolve::ModelSource;
use crate::streams::{ModelStreams, StreamTap};
use crate::target::HostHeads;
use crate::weights::WeightStore;

/// Largest head_dim the attention kernel takes.
const MAX_HEAD_DIM: usize = 128;

#[derive(Debug)]
pub(crate) struct CudaLayer {
    pub attn_norm: DeviceBuf<f32>,      // [hidden]
    pub qkv: DevProjection,             // [q + k + v, hidden]
    pub q_norm: Option<DeviceBuf<f32>>, // [head_dim]
    pub k_norm: Option<DeviceBuf<f32>>, // [head_dim]
    pub o_proj: DevMatrix,              // [hidden, heads * head_dim]
    pub ffn_norm: DeviceBuf<f32>,       // [hidden]
    pub gate_up: DevProjection,         // [2 * intermediate, hidden]
    pub down: DevMatrix,                // [hidden, intermediate]
}

/// A Llama-family target whose weights live on one GPU, uploaded once at load (bf16 kept bf16, GGUF
/// blocks kept quantized). Holds weights only, like [`crate::llama::LlamaModel`]: the KV pages, workspaces and
/// CUDA graphs are in the caller's [`crate::cuda::CudaCache`].
#[derive(Debug)]
pub struct CudaLlamaModel {
    pub(super) dev: Arc<CudaDevice>,
    pub(super) cfg: ModelConfig,
    pub(super) embed: DevMatrix, // [vocab, hidden]
    pub(super) layers: Vec<CudaLayer>,
    pub(super) final_norm: DeviceBuf<f32>, // [hidden]
    pub(super) lm_head: Option<DevMatrix>, // [vocab, hidden]; None = tied to `embed`
    pub(super) rope: CudaRopeTable,
    pub(super) capture_layers: Vec<usize>,
    /// Hyper-connection streams, when the config has them.
    pub(super) streams: Option<DevStreams>,
    /// Ties caches (whose graphs hold this model's weight addresses) to this model.
    pub(super) id: u64,
}

/// Storage of a random-weight model made on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RandomWeights {
    /// Every matrix bf16.
    Bf16,
    /// Layer matrices in `layers`, the embedding (and the tied or separate LM head) in `head`: the default
    /// model's mix is Q4_1 layers with a Q8_0 tied embedding.
    Quant { layers: QuantFormat, head: QuantFormat },
}

impl CudaLlamaModel {
    /// Builds the model from a weight store, taking every tensor the config implies (the family's layout,
    /// shared with [`crate::llama::LlamaModel::load`]) and uploading each once. RoPE positions are tabulated up to
    /// the config's context window. With `host_heads`, also returns host copies of the embedding, LM head and
    /// final norm for drafters. `stream_tap` says how taps read a stream target's streams.
    ///
    /// # Errors
    /// Missing, misshapen or unexpected tensors, capture layers out of range, a dtype or head size the
    /// kernels do not take, out of device memory.
    pub fn load(
        dev: Arc<CudaDevice>,
        cfg: ModelConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
        stream_tap: StreamTap,
        host_heads: bool,
    ) -> Result<(Self, Option<HostHeads>)> {
        check_config(&cfg, capture_layers)?;
        let layers = (0..cfg.num_layers)
            .map(|i| upload_layer(&dev, i, take_layer(&cfg, store, i)?))
            .collect::<Result<Vec<_>>>()?;
        let heads = take_heads(&cfg, store)?;
        let embed = DevMatrix::upload(&dev, "model.embed_tokens.weight", &heads.embed)?;
        let final_norm = upload_norm(&dev, &heads.final_norm)?;
        let lm_head = heads.lm_head.as_ref().map(|w| DevMatrix::upload(&dev, "lm_head.weight", w)).transpose()?;
        let rope = rope_table(&dev, &cfg)?;
        let (n, h) = (cfg.num_layers, cfg.hidden_size);
        let streams = ModelStreams::load(store, cfg.streams, n, h, capture_layers, stream_tap)?
            .map(|s| DevStreams::upload(&dev, &s, h, cfg.rms_norm_eps))
            .transpose()?;
        let host = match host_heads {
            true => Some(HostHeads {
                final_norm: heads.final_norm.to_f32()?,
                embedding: heads.embed,
                lm_head: heads.lm_head,
                eps: cfg.rms_norm_eps,
            }),
            false => None,
        };
        let model = CudaLlamaModel {
            dev,
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            rope,
            capture_layers: capture_layers.to_vec(),
            streams,
            id: next_model_id(),
        };
        Ok((model, host))
    }

    /// Loads a GGUF file or an HF directory (weights only, no tokenizer needed), strictly: every tensor must be
    /// used (tests; the engine's targets come through [`crate::open_target`]).
    ///
    /// # Errors
    /// As [`CudaLlamaModel::load`], unreadable files, another family's checkpoint.
    pub fn from_source(dev: Arc<CudaDevice>, source: &ModelSource, opts: &LoadOptions) -> Result<Self> {
        let (cfg, mut store) = crate::llama::weights_only(source, opts)?;
        let (model, _) = Self::load(dev, cfg, &mut store, &opts.capture_layers, opts.stream_tap, false)?;
        store.finish()?;
        Ok(model)
    }

    /// The model capturing `taps` at every forward (a random-weight model starts with none).
    ///
    /// # Errors
    /// A tap past the last layer.
    pub fn with_capture_layers(mut self, taps: &[usize]) -> Result<Self> {
        check_config(&self.cfg, taps)?;
        self.capture_layers = taps.to_vec();
        Ok(self)
    }

    /// A model of `cfg`'s shapes with random weights made on the device (benchmarks of real shapes):
    /// matrices uniform in `±1/√k` (bf16) or random quants, norms near 1.
    ///
    /// # Errors
    /// An unsupported shape, out of device memory, a launch failure.
    pub fn random(dev: Arc<CudaDevice>, cfg: ModelConfig, weights: RandomWeights, seed: u64) -> Result<Self> {
        check_config(&cfg, &[])?;
        let (layer_kind, head_kind) = match weights {
            RandomWeights::Bf16 => (MatrixKind::Bf16, MatrixKind::Bf16),
            RandomWeights::Quant { layers, head } => (MatrixKind::Quant(layers), MatrixKind::Quant(head)),
        };
        let mut seeds = (1u64..).map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i));
        let mut next = || seeds.next().unwrap_or(seed);
        let (h, v, f) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (qd, kd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let mat = |kind, n, k, s| DevMatrix::random(&dev, kind, n, k, s, 1.0 / (k as f32).sqrt());
        let norm = |len: usize, s: u64| -> Result<DeviceBuf<f32>> {
            let buf = dev.alloc_zeros(len)?;
            fill_random_f32(&dev, &buf, s, 0.1, 1.0)?;
            Ok(buf)
        };
        let qk_norm = matches!(cfg.arch, Architecture::Qwen3);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            layers.push(CudaLayer {
                attn_norm: norm(h, next())?,
                qkv: DevProjection::Fused(mat(layer_kind, qd + 2 * kd, h, next())?),
                q_norm: qk_norm.then(|| norm(cfg.head_dim, next())).transpose()?,
                k_norm: qk_norm.then(|| norm(cfg.head_dim, next())).transpose()?,
                o_proj: mat(layer_kind, h, qd, next())?,
                ffn_norm: norm(h, next())?,
                gate_up: DevProjection::Fused(mat(layer_kind, 2 * f, h, next())?),
                down: mat(layer_kind, h, f, next())?,
            });
        }
        let embed = mat(head_kind, v, h, next())?;
        let lm_head = (!cfg.tie_word_embeddings).then(|| mat(head_kind, v, h, next())).transpose()?;
        let final_norm = norm(h, next())?;
        let rope = rope_table(&dev, &cfg)?;
        dev.synchronize()?;
        Ok(CudaLlamaModel {
            dev,
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            rope,
            capture_layers: Vec::new(),
            streams: None,
            id: next_model_id(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The layers whose outputs every forward captures, fixed at load.
    pub fn capture_layers(&self) -> &[usize] {
        &self.capture_layers
    }

    /// Values of one captured row: `hidden` per tap, or what a stream target's taps read.
    pub fn capture_width(&self) -> usize {
        let taps = self.capture_layers.len();
        self.streams.as_ref().map_or(taps * self.cfg.hidden_size, |s| s.capture_width(taps))
    }

    /// How taps read the streams, on a stream target.
    pub fn stream_tap(&self) -> Option<StreamTap> {
        self.streams.as_ref().map(|s| s.tap)
    }

    /// Bytes of weights one decode step reads: every layer matrix and the LM head (the floor of a
    /// memory-bound step, with the KV cache read on top).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize =
            self.layers.iter().map(|l| l.qkv.bytes() + l.gate_up.bytes() + l.o_proj.bytes() + l.down.bytes()).sum();
        layers + self.lm_head().bytes() + self.streams.as_ref().map_or(0, DevStreams::weight_bytes)
    }

    pub(super) fn lm_head(&self) -> &DevMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Plans and allocates the device state for forwards within `cfg`'s capacities.
    ///
    /// # Errors
    /// Zero capacities, out of device memory.
    pub fn new_cache(&self, cfg: CudaCacheConfig) -> Result<CudaCache> {
        let c = &self.cfg;
        let (h, f, qd) = (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim);
        let shape = WorkspaceShape {
            hidden: h,
            q_width: qd,
            qkv_width: c.qkv_width(),
            ffn_width: f,
            bf16_width: if self.has_dense_weights() { h.max(f).max(qd) } else { 0 },
            quant_width: h.max(f).max(qd),
            quant_passes: self.quant_passes(),
            vocab: c.vocab_size,
            capture_width: self.capture_width(),
            capture_pages: true,
            residual_streams: self.streams.as_ref().map_or(0, |s| s.dims.streams),
            num_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            kv_layers: c.num_layers,
            folds_norms: true,
            tile_rows: self.tile_rows(),
            extra_inputs: 0,
        };
        CudaCache::new(&self.dev, cfg, &shape, self.id, ())
    }

    /// Whether any matrix is dense (its matmuls may go through cuBLAS).
    fn has_dense_weights(&self) -> bool {
        self.weights().any(|w| !matches!(w, DevWeight::Quant(_)))
    }

    /// The most activation passes of a block-quantized matrix (0: none), for the rows its matmuls quantize once.
    fn quant_passes(&self) -> usize {
        self.weights()
            .filter_map(|w| if let DevWeight::Quant(q) = w { Some(q.act.passes()) } else { None })
            .max()
            .unwrap_or(0)
    }

    /// Every matrix's weights: the LM head's, then each layer's.
    fn weights(&self) -> impl Iterator<Item = &DevWeight> {
        let layers = self.layers.iter().flat_map(|l| {
            let mut w = projection_weights(&l.qkv);
            w.extend(projection_weights(&l.gate_up));
            w.extend([&l.o_proj.w, &l.down.w]);
            w
        });
        std::iter::once(&self.lm_head().w).chain(layers)
    }

    /// Rows per attention tile (see [`TileRows`]): prompt rows on the tensor cores unless the weights are f32
    /// (f32 models are the exact reference the parity tests hold to 5e-6; bf16 and quantized ones already round
    /// their activations).
    pub(super) fn tile_rows(&self) -> TileRows {
        let exact = matches!(self.embed.w, DevWeight::F32(_));
        TileRows::new(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, !exact)
    }
}

fn check_config(cfg: &ModelConfig, capture_layers: &[usize]) -> Result<()> {
    if let Some(s) = cfg.streams.filter(|s| s.count > STREAMS_MAX) {
        return Err(CudaModelError::Unsupported(format!(
            "{} hyper-connection streams (at most {STREAMS_MAX})",
            s.count
        )));
    }
    if let Some(&l) = capture_layers.iter().find(|&&l| l >= cfg.num_layers) {
        return Err(CudaModelError::Unsupported(format!("capture layer {l} >= {} layers", cfg.num_layers)));
    }
    let group = cfg.num_heads / cfg.num_kv_heads.max(1);
    if cfg.head_dim > MAX_HEAD_DIM || !cfg.head_dim.is_multiple_of(4) || group > ATTN_MAX_QUERIES {
        return Err(CudaModelError::Unsupported(format!(
            "head_dim {} (a multiple of 4 up to {MAX_HEAD_DIM}) with {group} query heads per kv head (at most {ATTN_MAX_QUERIES})",
            cfg.head_dim
        )));
    }
    Ok(())
}

fn rope_table(dev: &CudaDevice, cfg: &ModelConfig) -> Result<CudaRopeTable> {
    let table = RopeTable::new(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling, cfg.rope_style)?;
    Ok(CudaRopeTable::new(dev, &table, cfg.max_position_embeddings.max(1))?)
}

fn upload_layer(dev: &CudaDevice, i: usize, t: LayerTensors) -> Result<CudaLayer> {
    let p = |s: &str| format!("model.layers.{i}.{s}");
    let norm = |w: Option<Tensor>| w.map(|w| upload_norm(dev, &w)).transpose();
    Ok(CudaLayer {
        attn_norm: upload_norm(dev, &t.attn_norm)?,
        qkv: DevProjection::upload(dev, &p("self_attn.qkv"), &[t.q, t.k, t.v])?,
        q_norm: norm(t.q_norm)?,
        k_norm: norm(t.k_norm)?,
        o_proj: DevMatrix::upload(dev, &p("self_attn.o_proj.weight"), &t.o_proj)?,
        ffn_norm: upload_norm(dev, &t.ffn_norm)?,
        gate_up: DevProjection::upload(dev, &p("mlp.gate_up"), &[t.gate, t.up])?,
        down: DevMatrix::upload(dev, &p("mlp.down_proj.weight"), &t.down)?,
    })
}

/// A projection's matrices' weights (one when fused).
fn projection_weights(p: &DevProjection) -> Vec<&DevWeight> {
    match p {
        DevProjection::Fused(m) => vec![&m.w],
        DevProjection::Split(parts) => parts.iter().map(|m| &m.w).collect(),
    }
}
