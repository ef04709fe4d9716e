//! The Llama family's checkpoint layout, named once for every device: HF tensor names and shapes (GGUF files
//! are read through the same names, mapped by the weight store).

use dflash_runtime::Tensor;

use crate::config::{Architecture, ModelConfig};
use crate::error::Result;
use crate::weights::WeightStore;

/// One decoder layer's tensors as the checkpoint stores them.
pub(crate) struct LayerTensors {
    pub attn_norm: Tensor,      // [hidden]
    pub q: Tensor,              // [heads * head_dim, hidden]
    pub k: Tensor,              // [kv_heads * head_dim, hidden]
    pub v: Tensor,              // [kv_heads * head_dim, hidden]
    pub q_norm: Option<Tensor>, // [head_dim] (Qwen3)
    pub k_norm: Option<Tensor>, // [head_dim] (Qwen3)
    pub o_proj: Tensor,         // [hidden, heads * head_dim]
    pub ffn_norm: Tensor,       // [hidden]
    pub gate: Tensor,           // [intermediate, hidden]
    pub up: Tensor,             // [intermediate, hidden]
    pub down: Tensor,           // [hidden, intermediate]
}

impl LayerTensors {
    /// The same tensors for another rank to slice ([`Tensor::share`]: views where the checkpoint is mapped).
    pub fn share(&self) -> LayerTensors {
        LayerTensors {
            attn_norm: self.attn_norm.share(),
            q: self.q.share(),
            k: self.k.share(),
            v: self.v.share(),
            q_norm: self.q_norm.as_ref().map(Tensor::share),
            k_norm: self.k_norm.as_ref().map(Tensor::share),
            o_proj: self.o_proj.share(),
            ffn_norm: self.ffn_norm.share(),
            gate: self.gate.share(),
            up: self.up.share(),
            down: self.down.share(),
        }
    }
}

/// Takes layer `i`'s tensors.
///
/// # Errors
/// Missing or misshapen tensors, named.
pub(crate) fn take_layer(cfg: &ModelConfig, store: &mut WeightStore, i: usize) -> Result<LayerTensors> {
    let p = |s: &str| format!("model.layers.{i}.{s}");
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (qd, kd, f) = (cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size);
    let (q_norm, k_norm) = match cfg.arch {
        Architecture::Qwen3 => (
            Some(store.take(&p("self_attn.q_norm.weight"), &[hd])?),
            Some(store.take(&p("self_attn.k_norm.weight"), &[hd])?),
        ),
        Architecture::Llama => (None, None),
    };
    Ok(LayerTensors {
        attn_norm: store.take(&p("input_layernorm.weight"), &[h])?,
        q: store.take(&p("self_attn.q_proj.weight"), &[qd, h])?,
        k: store.take(&p("self_attn.k_proj.weight"), &[kd, h])?,
        v: store.take(&p("self_attn.v_proj.weight"), &[kd, h])?,
        q_norm,
        k_norm,
        o_proj: store.take(&p("self_attn.o_proj.weight"), &[h, qd])?,
        ffn_norm: store.take(&p("post_attention_layernorm.weight"), &[h])?,
        gate: store.take(&p("mlp.gate_proj.weight"), &[f, h])?,
        up: store.take(&p("mlp.up_proj.weight"), &[f, h])?,
        down: store.take(&p("mlp.down_proj.weight"), &[h, f])?,
    })
}

/// The tensors around the layers.
pub(crate) struct HeadTensors {
    pub embed: Tensor,           // [vocab, hidden]
    pub final_norm: Tensor,      // [hidden]
    pub lm_head: Option<Tensor>, // [vocab, hidden]; None = tied to `embed`
}

/// Takes the embedding, the final norm and the LM head (marked used when tied to the embedding).
///
/// # Errors
/// Missing or misshapen tensors, named.
pub(crate) fn take_heads(cfg: &ModelConfig, store: &mut WeightStore) -> Result<HeadTensors> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let embed = store.take("model.embed_tokens.weight", &[v, h])?;
    let final_norm = store.take("model.norm.weight", &[h])?;
    let lm_head = if cfg.tie_word_embeddings {
        store.ignore("lm_head.weight");
        None
    } else {
        Some(store.take("lm_head.weight", &[v, h])?)
    };
    Ok(HeadTensors { embed, final_norm, lm_head })
}
