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
    /// Seeded random tensors of whatever name and shape a loader asks for: benchmarks of real shapes no checkpoint
    /// here has ([`random_tensor`]). Holds every name.
    Random {
        seed: u64,
    },
}

/// The tensor a [`WeightFile::Random`] store gives for `name` and `shape`: norm weights (`*norm.weight`) f32 in
/// `1 ± 0.1`, other vectors f32 in `± 0.1`, matrices bf16 uniform in `± 1/√k` (`k` the row length), so activations
/// keep their scale through a model's layers. A pure function of `(seed, name)`.
///
/// # Errors
/// A shape too large to allocate.
pub fn random_tensor(seed: u64, name: &str, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let name_seed =
        name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let uniform = |i: usize| {
        let mut z = name_seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    if shape.len() < 2 {
        let (scale, offset) = if name.ends_with("norm.weight") { (0.1, 1.0) } else { (0.1, 0.0) };
        let v: Vec<f32> = (0..n).map(|i| offset + scale * uniform(i)).collect();
        return Ok(Tensor::from_f32(&v, shape)?);
    }
    let scale = 1.0 / (shape[shape.len() - 1].max(1) as f32).sqrt();
    let bytes: Vec<u8> = {
        use rayon::prelude::*;
        (0..n).into_par_iter().flat_map_iter(|i| half::bf16::from_f32(scale * uniform(i)).to_le_bytes()).collect()
    };
    Ok(Tensor::from_bytes(dflash_runtime::DType::BF16, shape, &bytes)?)
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
            WeightFile::Hf(_) | WeightFile::Random { .. } => hf.to_string(),
            WeightFile::Gguf(_) => gguf_name(hf),
        }
    }

    /// Whether the checkpoint holds a tensor.
    pub fn contains(&self, hf: &str) -> bool {
        let n = self.native_name(hf);
        match &self.file {
            WeightFile::Gguf(g) => g.tensor_info(&n).is_some(),
            WeightFile::Hf(d) => d.names().any(|x| x == n),
            WeightFile::Random { .. } => true,
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
            WeightFile::Random { seed } => random_tensor(*seed, &name, shape)?,
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
            // Only the tensors taken exist.
            WeightFile::Random { .. } => self.used.iter().cloned().collect(),
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

#[cfg(test)]
mod random_tests {
    use super::*;

    #[test]
    fn random_tensors_keep_their_scale_and_repeat() {
        let norm = random_tensor(3, "model.norm.weight", &[64]).expect("norm");
        assert!(norm.as_f32().expect("f32").iter().all(|&x| (0.9..=1.1).contains(&x)));
        let w = random_tensor(3, "layers.0.mlp.up_proj.weight", &[8, 100]).expect("matrix");
        assert_eq!(w.dtype(), dflash_runtime::DType::BF16);
        let values = w.to_f32().expect("widen");
        let values = values.as_f32().expect("f32");
        assert!(values.iter().all(|x| x.abs() <= 0.1001) && values.iter().any(|x| x.abs() > 0.05));
        let again = random_tensor(3, "layers.0.mlp.up_proj.weight", &[8, 100]).expect("again");
        assert_eq!(again.bytes().expect("bytes"), w.bytes().expect("bytes"));
        let other = random_tensor(3, "layers.1.mlp.up_proj.weight", &[8, 100]).expect("other");
        assert_ne!(other.bytes().expect("bytes"), w.bytes().expect("bytes"));
        let mut store = WeightStore::new(WeightFile::Random { seed: 3 });
        assert!(store.contains("anything"));
        store.take("x.weight", &[4, 4]).expect("take");
        store.finish().expect("a random store holds only what was taken");
    }
}
