//! Building a [`CudaHybridModel`]: from a loaded CPU model (every tensor uploaded once, layouts as the
//! CPU layers regrouped them), or with random weights made on the device for benchmarks of real shapes.

use std::sync::Arc;

use dflash_runtime::cuda::ops::{
    fill_random_bf16, fill_random_f32, ATTN_MAX_QUERIES, GDN_MAX_CONV_KERNEL, GDN_MAX_K_HEAD_DIM,
};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf, STREAMS_MAX};
use dflash_runtime::ops::{RopeStyle, RopeTable};
use dflash_runtime::Tensor;

use super::{CudaHybridModel, DevAttention, DevExperts, DevFfn, DevGdn, DevHybridLayer, DevMixer, DevMoe};
use crate::cuda::{next_model_id, upload_norm, CudaModelError, DevMatrix, DevStreams, DevWeight, MatrixKind, Result};
use crate::hybrid::attention::Attention;
use crate::hybrid::gdn::GatedDeltaNet;
use crate::hybrid::moe::{Ffn, Mlp, SparseMoe};
use crate::hybrid::weights::{concat_rows, stack_rows};
use crate::hybrid::{FfnKind, HybridConfig, HybridModel, MixerKind};

/// Largest attention head the kernels take.
const MAX_HEAD_DIM: usize = 256;

impl CudaHybridModel {
    /// Uploads a loaded CPU model's weights (bf16 stays bf16, f32 stays f32). The CPU model can be dropped
    /// afterwards.
    ///
    /// # Errors
    /// Shapes the kernels do not take (head dims, conv kernel), quantized experts, out of device memory.
    pub fn from_host(dev: Arc<CudaDevice>, host: &HybridModel) -> Result<Self> {
        let cfg = host.cfg.clone();
        check_config(&cfg)?;
        let layers =
            host.layers.iter().enumerate().map(|(i, l)| upload_layer(&dev, &cfg, i, l)).collect::<Result<_>>()?;
        let lm_head = host.lm_head.as_ref().map(|t| DevMatrix::upload(&dev, "lm_head.weight", t)).transpose()?;
        let (h, eps) = (cfg.base.hidden_size, cfg.base.rms_norm_eps);
        let streams = host.streams.as_ref().map(|s| DevStreams::upload(&dev, s, h, eps)).transpose()?;
        Ok(CudaHybridModel {
            embed: DevMatrix::upload(&dev, "model.embed_tokens.weight", &host.embed)?,
            layers,
            final_norm: upload_norm(&dev, &host.final_norm)?,
            lm_head,
            rope: CudaRopeTable::new(&dev, &host.rope, cfg.base.max_position_embeddings.max(1))?,
            capture_layers: host.capture_layers.clone(),
            streams,
            id: next_model_id(),
            cfg,
            dev,
        })
    }

    /// A model of `cfg`'s shapes with random bf16 weights made on the device (matrices uniform in `±1/√k`,
    /// norms near 1, decays in a realistic range; hyper-connections when the config has streams); nothing is
    /// uploaded.
    ///
    /// # Errors
    /// Shapes the kernels do not take, out of device memory, a launch failure.
    pub fn random(dev: Arc<CudaDevice>, cfg: HybridConfig, seed: u64) -> Result<Self> {
        check_config(&cfg)?;
        let mut seeds = (1u64..).map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i));
        let mut next = move || seeds.next().unwrap_or(seed);
        let r = Random { dev: &dev };
        let b = &cfg.base;
        let (h, v) = (b.hidden_size, b.vocab_size);
        let mut layers = Vec::with_capacity(cfg.num_layers());
        let (mut attn_slot, mut gdn_slot) = (0, 0);
        for i in 0..cfg.num_layers() {
            let mixer = match cfg.mixers[i] {
                MixerKind::FullAttention => {
                    attn_slot += 1;
                    DevMixer::Attention(attn_slot - 1, r.attention(&cfg, &mut next)?)
                }
                MixerKind::LinearAttention => {
                    gdn_slot += 1;
                    DevMixer::Gdn(gdn_slot - 1, r.gdn(&cfg, &mut next)?)
                }
            };
            let ffn = match (cfg.ffns[i], cfg.moe) {
                (FfnKind::Sparse, Some(m)) => {
                    let (e, inter) = (m.num_experts, m.expert_intermediate);
                    let shared = m.shared_intermediate.is_some();
                    let gate_up = r.bf16(e * 2 * inter * h, 1.0 / (h as f32).sqrt(), next())?;
                    let down = r.bf16(e * h * inter, 1.0 / (inter as f32).sqrt(), next())?;
                    DevFfn::Sparse(DevMoe {
                        router: r.matrix(e + usize::from(shared), h, next())?,
                        experts: DevExperts::Bf16 { gate_up, down },
                        shared: m
                            .shared_intermediate
                            .map(|s| Ok::<_, CudaModelError>((r.matrix(2 * s, h, next())?, r.matrix(h, s, next())?)))
                            .transpose()?,
                    })
                }
                _ => {
                    let f = b.intermediate_size;
                    DevFfn::Dense { gate_up: r.matrix(2 * f, h, next())?, down: r.matrix(h, f, next())? }
                }
            };
            layers.push(DevHybridLayer { attn_norm: r.norm(h, next())?, mixer, ffn_norm: r.norm(h, next())?, ffn });
        }
        let rope = RopeTable::new(cfg.rotary_dim, b.rope_theta, &b.rope_scaling, RopeStyle::Neox)?;
        let dims = (h, b.rms_norm_eps);
        let streams = b.streams.map(|s| DevStreams::random(&dev, s, cfg.num_layers(), dims, &mut next)).transpose()?;
        let model = CudaHybridModel {
            embed: r.matrix(v, h, next())?,
            lm_head: (!b.tie_word_embeddings).then(|| r.matrix(v, h, next())).transpose()?,
            final_norm: r.norm(h, next())?,
            rope: CudaRopeTable::new(&dev, &rope, b.max_position_embeddings.max(1))?,
            layers,
            capture_layers: Vec::new(),
            streams,
            id: next_model_id(),
            cfg,
            dev: dev.clone(),
        };
        dev.synchronize()?;
        Ok(model)
    }
}

fn check_config(cfg: &HybridConfig) -> Result<()> {
    let b = &cfg.base;
    if let Some(s) = b.streams.filter(|s| s.count > STREAMS_MAX) {
        return Err(CudaModelError::Unsupported(format!(
            "{} hyper-connection streams (at most {STREAMS_MAX})",
            s.count
        )));
    }
    let group = b.num_heads / b.num_kv_heads.max(1);
    let bad_attn = b.head_dim > MAX_HEAD_DIM || !b.head_dim.is_multiple_of(4) || group > ATTN_MAX_QUERIES;
    let bad_gdn = cfg.gdn.is_some_and(|d| d.k_head_dim > GDN_MAX_K_HEAD_DIM || d.conv_kernel > GDN_MAX_CONV_KERNEL);
    if bad_attn || bad_gdn {
        return Err(CudaModelError::Unsupported(format!(
            "head_dim {} with {group} query heads per kv head, or GDN dims {:?} (key heads up to {GDN_MAX_K_HEAD_DIM}, \
             conv kernel up to {GDN_MAX_CONV_KERNEL})",
            b.head_dim, cfg.gdn
        )));
    }
    Ok(())
}

fn upload_layer(dev: &CudaDevice, cfg: &HybridConfig, i: usize, l: &crate::hybrid::Layer) -> Result<DevHybridLayer> {
    let mixer = match &l.mixer {
        crate::hybrid::Mixer::Attention(slot, a) => DevMixer::Attention(*slot, upload_attention(dev, cfg, i, a)?),
        crate::hybrid::Mixer::Gdn(slot, g) => DevMixer::Gdn(*slot, upload_gdn(dev, i, g)?),
    };
    let ffn = match &l.ffn {
        Ffn::Dense(m) => {
            let (gate_up, down) = upload_mlp(dev, &format!("model.layers.{i}.mlp"), m)?;
            DevFfn::Dense { gate_up, down }
        }
        Ffn::Sparse(m) => DevFfn::Sparse(upload_moe(dev, i, m)?),
    };
    Ok(DevHybridLayer {
        attn_norm: upload_norm(dev, &l.attn_norm)?,
        mixer,
        ffn_norm: upload_norm(dev, &l.ffn_norm)?,
        ffn,
    })
}

/// The CPU layer's `[q | gate | k | v]` rows reordered to `[q | k | v | gate]`.
fn upload_attention(dev: &CudaDevice, cfg: &HybridConfig, i: usize, a: &Attention) -> Result<DevAttention> {
    let b = &cfg.base;
    let (qd, kd) = (b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim);
    let reordered;
    let qkv = if a.gated {
        let q = &a.qkv;
        reordered = stack_rows(&[(q, 0..qd), (q, 2 * qd..2 * qd + 2 * kd), (q, qd..2 * qd)])?;
        &reordered
    } else {
        &a.qkv
    };
    let name = format!("model.layers.{i}.self_attn");
    Ok(DevAttention {
        qkv: DevMatrix::upload(dev, &format!("{name}.qkv"), qkv)?,
        q_norm: a.q_norm.as_ref().map(|n| upload_norm(dev, n)).transpose()?,
        k_norm: a.k_norm.as_ref().map(|n| upload_norm(dev, n)).transpose()?,
        o_proj: DevMatrix::upload(dev, &format!("{name}.o_proj"), &a.o_proj)?,
        gated: a.gated,
    })
}

fn upload_gdn(dev: &CudaDevice, i: usize, g: &GatedDeltaNet) -> Result<DevGdn> {
    let name = format!("model.layers.{i}.linear_attn");
    Ok(DevGdn {
        in_proj: DevMatrix::upload(dev, &format!("{name}.in_proj"), &g.in_proj)?,
        conv_w: dev.upload(&g.conv_w)?,
        neg_a: dev.upload(&g.neg_a)?,
        dt_bias: dev.upload(&g.dt_bias)?,
        norm: dev.upload(&g.norm)?,
        out_proj: DevMatrix::upload(dev, &format!("{name}.out_proj"), &g.out_proj)?,
    })
}

fn upload_mlp(dev: &CudaDevice, name: &str, m: &Mlp) -> Result<(DevMatrix, DevMatrix)> {
    Ok((
        DevMatrix::upload(dev, &format!("{name}.gate_up"), &m.gate_up)?,
        DevMatrix::upload(dev, &format!("{name}.down"), &m.down)?,
    ))
}

/// The experts stacked into one buffer each (`gate_up` `[E·2I, H]`, `down` `[E·H, I]`).
fn upload_moe(dev: &CudaDevice, i: usize, m: &SparseMoe) -> Result<DevMoe> {
    let name = format!("model.layers.{i}.mlp");
    let stack = |what: &str, parts: Vec<&Tensor>| -> Result<DevWeight> {
        let t = concat_rows(&parts)?;
        Ok(DevMatrix::upload(dev, &format!("{name}.experts.{what}"), &t)?.w)
    };
    let gate_up = stack("gate_up", m.experts.iter().map(|e| &e.gate_up).collect())?;
    let down = stack("down", m.experts.iter().map(|e| &e.down).collect())?;
    let experts = match (gate_up, down) {
        (DevWeight::Bf16(gate_up), DevWeight::Bf16(down)) => DevExperts::Bf16 { gate_up, down },
        (DevWeight::F32(gate_up), DevWeight::F32(down)) => DevExperts::F32 { gate_up, down },
        _ => return Err(CudaModelError::Unsupported(format!("{name}: experts must be bf16 or f32, both alike"))),
    };
    Ok(DevMoe {
        router: DevMatrix::upload(dev, &format!("{name}.gate"), &m.router)?,
        experts,
        shared: m.shared.as_ref().map(|s| upload_mlp(dev, &format!("{name}.shared_expert"), s)).transpose()?,
    })
}

/// Random device weights.
struct Random<'d> {
    dev: &'d CudaDevice,
}

impl Random<'_> {
    fn matrix(&self, n: usize, k: usize, seed: u64) -> Result<DevMatrix> {
        DevMatrix::random(self.dev, MatrixKind::Bf16, n, k, seed, 1.0 / (k as f32).sqrt())
    }

    fn bf16(&self, len: usize, scale: f32, seed: u64) -> Result<DeviceBuf<half::bf16>> {
        let buf = self.dev.alloc_zeros(len)?;
        fill_random_bf16(self.dev, &buf, seed, scale, 0.0)?;
        Ok(buf)
    }

    /// `offset ± scale`, f32.
    fn f32s(&self, len: usize, scale: f32, offset: f32, seed: u64) -> Result<DeviceBuf<f32>> {
        let buf = self.dev.alloc_zeros(len)?;
        fill_random_f32(self.dev, &buf, seed, scale, offset)?;
        Ok(buf)
    }

    fn norm(&self, len: usize, seed: u64) -> Result<DeviceBuf<f32>> {
        self.f32s(len, 0.1, 1.0, seed)
    }

    fn attention(&self, cfg: &HybridConfig, next: &mut impl FnMut() -> u64) -> Result<DevAttention> {
        let b = &cfg.base;
        let (h, qd, kd) = (b.hidden_size, b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim);
        let gated = cfg.attn_output_gate;
        let rows = if gated { 2 * qd } else { qd } + 2 * kd;
        Ok(DevAttention {
            qkv: self.matrix(rows, h, next())?,
            q_norm: Some(self.norm(b.head_dim, next())?),
            k_norm: Some(self.norm(b.head_dim, next())?),
            o_proj: self.matrix(h, qd, next())?,
            gated,
        })
    }

    fn gdn(&self, cfg: &HybridConfig, next: &mut impl FnMut() -> u64) -> Result<DevGdn> {
        let d = cfg.gdn.ok_or_else(|| CudaModelError::Unsupported("a GDN layer without GDN dims".into()))?;
        let h = cfg.base.hidden_size;
        let hv = d.num_v_heads;
        Ok(DevGdn {
            in_proj: self.matrix(d.conv_dim() + d.value_dim() + 2 * hv, h, next())?,
            conv_w: self.f32s(d.conv_dim() * d.conv_kernel, 0.5, 0.0, next())?,
            // −exp(A_log) in [−1.5, −0.5], dt_bias near zero: decays e^g of about 0.3 to 0.9 per token.
            neg_a: self.f32s(hv, 0.5, -1.0, next())?,
            dt_bias: self.f32s(hv, 0.5, 0.0, next())?,
            norm: self.norm(d.v_head_dim, next())?,
            out_proj: self.matrix(h, d.value_dim(), next())?,
        })
    }
}
