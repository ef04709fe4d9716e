//! Builds a `tokenizers::Tokenizer` from the byte-level BPE vocabulary stored in a GGUF file.
//!
//! GGUF keeps only the token list, merges, token types and a pre-tokenizer name (`tokenizer.ggml.pre`); the rest of
//! the Hugging Face pipeline is implied by that name. The mapping here mirrors what the original `tokenizer.json`
//! files of those model families contain, so the ids match Hugging Face's exactly.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::{GgufVocab, TokenizerError, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};

/// Llama 3 split regex (`tokenizer.json` of Meta-Llama-3): letters with one leading non-letter, numbers in groups
/// of up to three digits, punctuation runs with trailing newlines.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2/Qwen3 split regex: as Llama 3 but every digit is its own piece.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenization families that `tokenizer.ggml.pre` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PreTokenizerKind {
    /// GPT-2's byte-level regex, no prefix space.
    Gpt2,
    /// Individual digits, then GPT-2's byte-level regex (SmolLM, StarCoder).
    DigitsThenGpt2,
    /// Llama 3 regex; whole words found in the vocabulary skip the merges.
    Llama3,
    /// Qwen2 regex after NFC normalization.
    Qwen2,
}

impl PreTokenizerKind {
    /// Maps a `tokenizer.ggml.pre` value (absent means llama.cpp's "default", i.e. GPT-2) to a family.
    ///
    /// # Errors
    /// `UnsupportedPreTokenizer` for names whose split rules are not implemented here: tokenizing with the wrong
    /// regex would silently produce ids the model was not trained on.
    pub(super) fn from_gguf_pre(pre: Option<&str>) -> Result<Self, TokenizerError> {
        match pre.unwrap_or("default") {
            "default" | "gpt2" | "gpt-2" => Ok(Self::Gpt2),
            "smollm" | "starcoder" | "refact" => Ok(Self::DigitsThenGpt2),
            "llama-bpe" | "llama3" | "llama-v3" => Ok(Self::Llama3),
            "qwen2" | "deepseek-r1-qwen" => Ok(Self::Qwen2),
            other => Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        }
    }

    fn pre_tokenizer(self) -> Result<PreTokenizerWrapper, TokenizerError> {
        // ByteLevel(add_prefix_space=false): adding a prefix space (the ByteLevel default) changes the first id.
        let byte_level = |use_regex: bool| PreTokenizerWrapper::from(ByteLevel::new(false, true, use_regex));
        let split = |pattern: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
            let split = Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)?;
            Ok(split.into())
        };
        Ok(match self {
            Self::Gpt2 => byte_level(true),
            Self::DigitsThenGpt2 => Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
            Self::Llama3 => Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false)]).into(),
            Self::Qwen2 => Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false)]).into(),
        })
    }
}

/// Builds the tokenizer for a GGUF byte-level BPE vocabulary.
///
/// # Errors
/// See [`super::Tokenizer::from_gguf`].
pub(super) fn build(v: &GgufVocab) -> Result<tokenizers::Tokenizer, TokenizerError> {
    if v.model != "gpt2" {
        return Err(TokenizerError::UnsupportedModel(v.model.clone()));
    }
    if !v.token_types.is_empty() && v.token_types.len() != v.tokens.len() {
        return Err(TokenizerError::InvalidVocab(format!(
            "{} token types for {} tokens",
            v.token_types.len(),
            v.tokens.len()
        )));
    }
    let kind = PreTokenizerKind::from_gguf_pre(v.pre.as_deref())?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_map(&v.tokens)?, split_merges(&v.merges)?)
        .ignore_merges(kind == PreTokenizerKind::Llama3)
        .build()
        .map_err(|e| TokenizerError::InvalidVocab(e.to_string()))?;

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(kind.pre_tokenizer()?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    if kind == PreTokenizerKind::Qwen2 {
        tok.with_normalizer(Some(NFC));
    }
    tok.add_tokens(&added_tokens(v));
    Ok(tok)
}

/// Token string -> id for every GGUF token, control tokens included, so that added tokens keep their GGUF ids
/// (the tokenizers library appends tokens it does not find in the model vocabulary after the last id).
fn vocab_map(tokens: &[String]) -> Result<Vocab, TokenizerError> {
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        let id = u32::try_from(id).map_err(|_| TokenizerError::InvalidVocab("more than 2^32 tokens".into()))?;
        // A duplicated string keeps its first id, as llama.cpp's text-to-token map does.
        vocab.entry(token.clone()).or_insert(id);
    }
    Ok(vocab)
}

/// Splits GGUF merges ("Ġ t") into pairs. Byte-level tokens never contain a plain space, so it is the separator.
fn split_merges(merges: &[String]) -> Result<Merges, TokenizerError> {
    merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((left, right)) if !left.is_empty() && !right.is_empty() && !right.contains(' ') => {
                Ok((left.to_string(), right.to_string()))
            }
            _ => Err(TokenizerError::InvalidVocab(format!("malformed merge `{m}`"))),
        })
        .collect()
}

/// Control tokens become special added tokens (skippable on decode), user-defined ones plain added tokens; both are
/// matched verbatim in the input before BPE runs.
fn added_tokens(v: &GgufVocab) -> Vec<AddedToken> {
    v.tokens
        .iter()
        .zip(&v.token_types)
        .filter_map(|(token, &ty)| match ty {
            TOKEN_TYPE_CONTROL => Some(AddedToken::from(token.clone(), true)),
            TOKEN_TYPE_USER_DEFINED => Some(AddedToken::from(token.clone(), false)),
            _ => None,
        })
        .filter(|t| !t.content.is_empty())
        .map(|t| t.normalized(false))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_names_map_to_families() {
        let kind = |p: Option<&str>| PreTokenizerKind::from_gguf_pre(p).ok();
        assert_eq!(kind(None), Some(PreTokenizerKind::Gpt2));
        assert_eq!(kind(Some("smollm")), Some(PreTokenizerKind::DigitsThenGpt2));
        assert_eq!(kind(Some("llama-bpe")), Some(PreTokenizerKind::Llama3));
        assert_eq!(kind(Some("qwen2")), Some(PreTokenizerKind::Qwen2));
        assert!(matches!(
            PreTokenizerKind::from_gguf_pre(Some("chatglm-bpe")),
            Err(TokenizerError::UnsupportedPreTokenizer(p)) if p == "chatglm-bpe"
        ));
    }

    #[test]
    fn merges_split_on_the_single_space() {
        let merges = vec!["Ġ t".to_string(), "i n".to_string()];
        let pairs = split_merges(&merges).expect("valid merges");
        assert_eq!(pairs, vec![("Ġ".into(), "t".into()), ("i".into(), "n".into())]);
        assert!(split_merges(&["abc".to_string()]).is_err());
        assert!(split_merges(&["a b c".to_string()]).is_err());
    }

    #[test]
    fn every_pre_tokenizer_builds() {
        for kind in [
            PreTokenizerKind::Gpt2,
            PreTokenizerKind::DigitsThenGpt2,
            PreTokenizerKind::Llama3,
            PreTokenizerKind::Qwen2,
        ] {
            assert!(kind.pre_tokenizer().is_ok(), "{kind:?}");
        }
    }
}
