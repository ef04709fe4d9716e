//! The engine's tokenizer as llguidance sees it: a token trie over each id's bytes, special tokens marked as
//! llguidance expects (`0xFF` then the name), and the model's end-of-sequence ids.

use std::sync::Arc;

use dflash_models::tokenizer::{TokenPiece, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// The trie and tokenizer behind a grammar compiler.
struct EngineTokens {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for EngineTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Used by llguidance for bytes a grammar forces, which may end or start inside a multi-byte character (a
    /// choice `"no ✗"` forces the rest of `✗` once its first byte is out): whole characters go through the
    /// tokenizer, stray bytes through the trie's byte tokens, so no byte is ever replaced.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| self.tokenizer.encode(text, false).unwrap_or_default())
    }
}

/// Builds the token environment of `tokenizer`.
///
/// # Errors
/// A message when the tokenizer has no end-of-sequence id (a grammar could never let generation end).
pub(super) fn token_env(tokenizer: &Tokenizer) -> Result<TokEnv, String> {
    let words: Vec<Vec<u8>> = tokenizer.token_pieces().into_iter().map(word).collect();
    let eos: Vec<TokenId> = tokenizer.eos_ids().iter().copied().filter(|&id| (id as usize) < words.len()).collect();
    let Some(&first_eos) = eos.first() else {
        return Err("the tokenizer has no end-of-sequence token".into());
    };
    let mut info = TokRxInfo::new(words.len() as u32, first_eos);
    info.tok_bos = tokenizer.bos_id();
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Ok(Arc::new(EngineTokens { trie, tokenizer: tokenizer.clone() }))
}

fn word(piece: TokenPiece) -> Vec<u8> {
    match piece {
        TokenPiece::Bytes(bytes) => bytes,
        TokenPiece::Special(name) => {
            let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            marked.extend_from_slice(name.as_bytes());
            marked
        }
    }
}
