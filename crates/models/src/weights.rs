//! Strict weight loading: tensors are asked for by their HF names, mapped to GGUF names where needed,
//! checked against the shape the config implies, and every tensor in the checkpoint must be used.

use std::collections::BTreeSet;

use dflash_runtime::Tensor;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::safetensors_dir::SafetensorsDir;

/// Where weights come from.
pub enum WeightFile {
    Gguf(GgufFile),
    Hf(SafetensorsDir),
}

/// Hands out tensors by HF name and remembers which were used.
pub struct WeightStore {
    file: WeightFile,
    used: BTreeSet<String>,
    /// Widen every tensor to f32 as it is taken (reference runs that isolate kernel error from model logic).
    widen_to_f32: bool,
}

impl WeightStore {
    pub fn new(file: WeightFile) -> Self {
        WeightStore { file, used: BTreeSet::new(), widen_to_f32: false }
    }

    /// Makes [`WeightStore::take`] return f32 tensors whatever the stored dtype.
    pub fn widen_to_f32(mut self, on: bool) -> Self {
        self.widen_to_f32 = on;
        self
    }

    /// The file's own name for an HF tensor name.
    fn native_name(&self, hf: &str) -> String {
        match &self.file {
            WeightFile::Hf(_) => hf.to_string(),
            WeightFile::Gguf(_) => gguf_name(hf),
        }
    }

    /// Whether the checkpoint holds a tensor.
    pub fn contains(&self, hf: &str) -> bool {
        let n = self.native_name(hf);
        match &self.file {
            WeightFile::Gguf(g) => g.tensor_info(&n).is_some(),
            WeightFile::Hf(d) => d.names().any(|x| x == n),
        }
    }

    /// Takes a tensor and checks its shape.
    ///
    /// # Errors
    /// `MissingTensor` or `TensorShape`, both naming the tensor as the file names it.
    pub fn take(&mut self, hf: &str, shape: &[usize]) -> Result<Tensor> {
        let name = self.native_name(hf);
        let t = match &self.file {
            WeightFile::Gguf(g) => g.tensor(&name)?,
            WeightFile::Hf(d) => d.tensor(&name)?,
        };
        // A 1-d GGUF/HF vector may be stored as [n]; compare element layout exactly otherwise.
        if t.shape() != shape {
            return Err(ModelError::TensorShape { name, expected: shape.to_vec(), got: t.shape().to_vec() });
        }
        self.used.insert(name);
        if self.widen_to_f32 && t.dtype() != dflash_runtime::DType::F32 {
            return Ok(t.to_f32()?);
        }
        Ok(t)
    }

    /// Marks a tensor as deliberately unused (e.g. a stored copy of tied embeddings).
    pub fn ignore(&mut self, hf: &str) {
        let n = self.native_name(hf);
        self.used.insert(n);
    }

    /// Marks every tensor whose name starts with `prefix` as deliberately unused (tensors another loader reads,
    /// such as a hybrid checkpoint's MTP head).
    pub fn ignore_under(&mut self, prefix: &str) {
        for name in self.names() {
            if name.starts_with(prefix) {
                self.used.insert(name);
            }
        }
    }

    /// The file's own names of all its tensors.
    fn names(&self) -> Vec<String> {
        match &self.file {
            WeightFile::Gguf(g) => g.tensor_infos().iter().map(|t| t.name.clone()).collect(),
            WeightFile::Hf(d) => d.names().map(str::to_string).collect(),
        }
    }

    /// Errors if the checkpoint holds tensors nobody took.
    ///
    /// # Errors
    /// `UnexpectedTensors` listing them.
    pub fn finish(self) -> Result<WeightFile> {
        let mut extra: Vec<String> = self
            .names()
            .into_iter()
            .filter(|n| !self.used.contains(n) && !n.ends_with("rotary_emb.inv_freq"))
            .collect();
        if !extra.is_empty() {
            extra.sort();
            return Err(ModelError::UnexpectedTensors(extra));
        }
        Ok(self.file)
    }
}

/// Maps an HF Llama/Qwen3 tensor name to llama.cpp's GGUF name.
pub fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let Some(rest) = hf.strip_prefix("model.layers.") else { return hf.to_string() };
    let Some((layer, part)) = rest.split_once('.') else { return hf.to_string() };
    let mapped = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => return format!("blk.{layer}.{other}"),
    };
    format!("blk.{layer}.{mapped}")
}

#[cfg(test)]
mod tests {
    use super::gguf_name;

    #[test]
    fn maps_hf_names_to_gguf() {
        assert_eq!(gguf_name("model.layers.12.self_attn.k_proj.weight"), "blk.12.attn_k.weight");
        assert_eq!(gguf_name("model.layers.0.mlp.down_proj.weight"), "blk.0.ffn_down.weight");
        assert_eq!(gguf_name("lm_head.weight"), "output.weight");
    }
}
