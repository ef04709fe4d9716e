//! Tokenization, chat templates and streaming detokenization.
//!
//! A [`Tokenizer`] is built either from the `tokenizer.ggml.*` metadata of a GGUF file ([`GgufVocab`]) or from a
//! Hugging Face model directory (`tokenizer.json` and friends). Both paths end in a `tokenizers::Tokenizer`, so the
//! BPE, pre-tokenization and added-token handling are the reference implementation's, not a re-implementation.

mod chat_template;
mod detok;
mod gguf_bpe;
mod hf_dir;
mod pyjson;
mod strftime;
mod token_bytes;

use std::path::{Path, PathBuf};

pub use chat_template::{ChatMessage, ChatTemplate};
pub use detok::{DecodeState, IncrementalDecoder};
pub use token_bytes::TokenPiece;

/// Tokenizer metadata as a GGUF file stores it (filled by the gguf module from `tokenizer.ggml.*` keys).
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: "gpt2" for byte-level BPE, "llama" for SentencePiece, ...
    pub model: String,
    /// `tokenizer.ggml.pre`: names the pre-tokenizer (split regex) of a BPE vocabulary.
    pub pre: Option<String>,
    /// Token strings indexed by id.
    pub tokens: Vec<String>,
    /// GGUF token types indexed by id (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub token_types: Vec<i32>,
    /// BPE merges as "left right", highest priority first.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub add_bos: bool,
    /// SentencePiece's leading-space rule; byte-level BPE (the only model built from GGUF here) ignores it.
    pub add_space_prefix: bool,
    pub chat_template: Option<String>,
}

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("unsupported GGUF tokenizer model `{0}` (only byte-level BPE, `gpt2`, is supported from GGUF)")]
    UnsupportedModel(String),
    #[error("unsupported GGUF pre-tokenizer `{0}`")]
    UnsupportedPreTokenizer(String),
    #[error("invalid tokenizer vocabulary: {0}")]
    InvalidVocab(String),
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("invalid JSON in {path}: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("invalid tokenizer config {path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("tokenizer: {0}")]
    Backend(#[from] tokenizers::Error),
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
    #[error("chat template context: {0}")]
    TemplateContext(String),
    #[error("incremental decoding: text of token {token_id} does not extend the previous text")]
    StreamPrefix { token_id: u32 },
}

/// GGUF token type of a control token such as `<|im_start|>`.
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of a user-defined added token (matched in text, but not special).
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// A text tokenizer plus the special ids and chat template that go with a model.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    /// Prepend BOS when encoding with `add_special` (unless the post-processor already did).
    add_bos: bool,
    chat_template: Option<ChatTemplate>,
}

/// A summary: the derived form would print the whole vocabulary.
impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    ///
    /// # Errors
    /// `UnsupportedModel` for anything but byte-level BPE (`gpt2`), `UnsupportedPreTokenizer` for an unknown
    /// `tokenizer.ggml.pre`, `InvalidVocab` for inconsistent arrays or merges, `Template` for a chat template that
    /// does not parse.
    pub fn from_gguf(v: &GgufVocab) -> Result<Self, TokenizerError> {
        let inner = gguf_bpe::build(v)?;
        let token = |id: Option<u32>| id.and_then(|i| v.tokens.get(i as usize).cloned());
        let chat_template = match &v.chat_template {
            Some(src) => Some(ChatTemplate::new(src, token(v.bos_id), token(v.eos_id))?),
            None => None,
        };
        Ok(Tokenizer {
            inner,
            vocab_size: v.tokens.len(),
            bos_id: v.bos_id,
            eos_ids: v.eos_id.into_iter().collect(),
            add_bos: v.add_bos,
            chat_template,
        })
    }

    /// Loads a Hugging Face tokenizer directory: `tokenizer.json`, plus `tokenizer_config.json` (special tokens,
    /// `add_bos_token`, chat template), `chat_template.jinja` and `generation_config.json` (extra EOS ids) when present.
    ///
    /// # Errors
    /// `Io`/`Json`/`Config` for missing or malformed files, `Backend` when `tokenizer.json` is rejected by the
    /// tokenizers library, `Template` for a chat template that does not parse.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let parts = hf_dir::load(dir)?;
        let vocab_size = parts.inner.get_vocab_size(true);
        Ok(Tokenizer {
            inner: parts.inner,
            vocab_size,
            bos_id: parts.bos_id,
            eos_ids: parts.eos_ids,
            add_bos: parts.add_bos,
            chat_template: parts.chat_template,
        })
    }

    /// Encodes text to ids. Special and added tokens written literally in `text` (e.g. `<|im_start|>`) map to
    /// their ids. With `add_special`, the post-processor runs and BOS is prepended when the model asks for it,
    /// unless the text already starts with it (chat templates often write `{{ bos_token }}` themselves).
    ///
    /// # Errors
    /// `Backend` when the tokenizers library fails (e.g. a pre-tokenizer regex error).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode_fast(text, add_special)?;
        let ids = encoding.get_ids();
        match self.bos_id {
            // Some HF tokenizers rely on the slow tokenizer's `add_bos_token` instead of a post-processor.
            Some(bos) if add_special && self.add_bos && ids.first() != Some(&bos) => {
                let mut with_bos = Vec::with_capacity(ids.len() + 1);
                with_bos.push(bos);
                with_bos.extend_from_slice(ids);
                Ok(with_bos)
            }
            _ => Ok(ids.to_vec()),
        }
    }

    /// Decodes ids to text; ids outside the vocabulary are ignored. `skip_special` drops special (control) tokens.
    ///
    /// # Errors
    /// `Backend` when the decoder fails.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        Ok(self.inner.decode(ids, skip_special)?)
    }

    /// Number of token ids the tokenizer knows (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end generation (the tokenizer's EOS first, then any extra ones from `generation_config.json`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    /// The stored token string (byte-level BPE tokens come back in their byte-level form, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }
}

#[cfg(test)]
mod test_vocab;
#[cfg(test)]
mod tests;
