//! [`CudaLlamaModel`]: a Llama-family target (Llama, SmolLM2, Qwen3 dense) with its weights on one GPU.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dflash_runtime::cuda::ops::{fill_random_f32, QuantFormat, ATTN_MAX_QUERIES};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf};
use dflash_runtime::ops::RopeTable;

use super::error::{CudaModelError, Result};
use super::plan::TileRows;
use super::weights::{upload_norm, DevMatrix, DevProjection, DevWeight, MatrixKind};
use crate::config::{merge_json, Architecture, ModelConfig};
use crate::gguf::GgufFile;
use crate::loader::LoadOptions;
use crate::resolve::ModelSource;
use crate::safetensors_dir::{read_json, SafetensorsDir};
use crate::weights::{WeightFile, WeightStore};

/// Largest head_dim the attention kernel takes.
const MAX_HEAD_DIM: usize = 128;

#[derive(Debug)]
pub(super) struct CudaLayer {
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
/// blocks kept quantized). Holds weights only, like [`crate::LlamaModel`]: the KV pages, workspaces and
/// CUDA graphs are in the caller's [`super::CudaCache`].
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

pub(super) fn next_model_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl CudaLlamaModel {
    /// Builds the model from a weight store, taking every tensor the config implies (the same names and
    /// shapes as [`crate::LlamaModel::load`]) and uploading each once. RoPE positions are tabulated up to
    /// the config's context window.
    ///
    /// # Errors
    /// Missing, misshapen or unexpected tensors, capture layers out of range, a dtype or head size the
    /// kernels do not take, out of device memory.
    pub fn load(
        dev: Arc<CudaDevice>,
        cfg: ModelConfig,
        store: &mut WeightStore,
        capture_layers: &[usize],
    ) -> Result<Self> {
        check_config(&cfg, capture_layers)?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed =
            DevMatrix::upload(&dev, "model.embed_tokens.weight", &store.take("model.embed_tokens.weight", &[v, h])?)?;
        let layers = (0..cfg.num_layers).map(|i| load_layer(&dev, &cfg, store, i)).collect::<Result<Vec<_>>>()?;
        let final_norm = upload_norm(&dev, &store.take("model.norm.weight", &[h])?)?;
        let lm_head = if cfg.tie_word_embeddings {
            store.ignore("lm_head.weight");
            None
        } else {
            Some(DevMatrix::upload(&dev, "lm_head.weight", &store.take("lm_head.weight", &[v, h])?)?)
        };
        let rope = rope_table(&dev, &cfg)?;
        Ok(CudaLlamaModel {
            dev,
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            rope,
            capture_layers: capture_layers.to_vec(),
            id: next_model_id(),
        })
    }

    /// Loads a GGUF file or an HF directory (weights only; the tokenizer comes from
    /// [`crate::load_model`] or [`crate::tokenizer::Tokenizer`]). Strict like the CPU loader: every tensor
    /// of the checkpoint must be used.
    ///
    /// # Errors
    /// As [`CudaLlamaModel::load`], unreadable files, and `config_overrides` on a GGUF file (not supported
    /// here yet).
    pub fn from_source(dev: Arc<CudaDevice>, source: &ModelSource, opts: &LoadOptions) -> Result<Self> {
        let (cfg, store) = match source {
            ModelSource::GgufFile(path) => gguf_parts(path, opts)?,
            ModelSource::HfDir(dir) => hf_parts(dir, opts)?,
        };
        let mut store = store.widen_to_f32(opts.f32_weights);
        let model = Self::load(dev, cfg, &mut store, &opts.capture_layers)?;
        store.finish()?;
        Ok(model)
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

    /// Bytes of weights one decode step reads: every layer matrix and the LM head (the floor of a
    /// memory-bound step, with the KV cache read on top).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize =
            self.layers.iter().map(|l| l.qkv.bytes() + l.gate_up.bytes() + l.o_proj.bytes() + l.down.bytes()).sum();
        layers + self.lm_head().bytes()
    }

    pub(super) fn lm_head(&self) -> &DevMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
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

fn load_layer(dev: &CudaDevice, cfg: &ModelConfig, store: &mut WeightStore, i: usize) -> Result<CudaLayer> {
    let p = |s: &str| format!("model.layers.{i}.{s}");
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (qd, kd, f) = (cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size);
    let q = store.take(&p("self_attn.q_proj.weight"), &[qd, h])?;
    let k = store.take(&p("self_attn.k_proj.weight"), &[kd, h])?;
    let v = store.take(&p("self_attn.v_proj.weight"), &[kd, h])?;
    let (q_norm, k_norm) = match cfg.arch {
        Architecture::Qwen3 => (
            Some(upload_norm(dev, &store.take(&p("self_attn.q_norm.weight"), &[hd])?)?),
            Some(upload_norm(dev, &store.take(&p("self_attn.k_norm.weight"), &[hd])?)?),
        ),
        Architecture::Llama => (None, None),
    };
    let gate = store.take(&p("mlp.gate_proj.weight"), &[f, h])?;
    let up = store.take(&p("mlp.up_proj.weight"), &[f, h])?;
    let o_name = p("self_attn.o_proj.weight");
    let down_name = p("mlp.down_proj.weight");
    Ok(CudaLayer {
        attn_norm: upload_norm(dev, &store.take(&p("input_layernorm.weight"), &[h])?)?,
        qkv: DevProjection::upload(dev, &p("self_attn.qkv"), &[q, k, v])?,
        q_norm,
        k_norm,
        o_proj: DevMatrix::upload(dev, &o_name, &store.take(&o_name, &[h, qd])?)?,
        ffn_norm: upload_norm(dev, &store.take(&p("post_attention_layernorm.weight"), &[h])?)?,
        gate_up: DevProjection::upload(dev, &p("mlp.gate_up"), &[gate, up])?,
        down: DevMatrix::upload(dev, &down_name, &store.take(&down_name, &[h, f])?)?,
    })
}

fn gguf_parts(path: &Path, opts: &LoadOptions) -> Result<(ModelConfig, WeightStore)> {
    if opts.config_overrides.is_some() {
        return Err(CudaModelError::Unsupported("--config-overrides on a GGUF model".into()));
    }
    let gguf = GgufFile::open(path)?;
    let cfg = ModelConfig::from_gguf(&gguf)?;
    Ok((cfg, WeightStore::new(WeightFile::Gguf(gguf))))
}

fn hf_parts(dir: &Path, opts: &LoadOptions) -> Result<(ModelConfig, WeightStore)> {
    let mut config = read_json(&dir.join("config.json"))?;
    if let Some(o) = &opts.config_overrides {
        merge_json(&mut config, o);
    }
    let cfg = ModelConfig::from_hf(&config)?;
    Ok((cfg, WeightStore::new(WeightFile::Hf(SafetensorsDir::open(dir)?))))
}
