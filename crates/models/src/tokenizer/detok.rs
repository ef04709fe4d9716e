//! Streaming detokenization.
//!
//! Byte-level BPE tokens are byte strings: one token may end in the middle of a UTF-8 character, and SentencePiece
//! style decoders change a token's text depending on what precedes it. Decoding each token alone therefore produces
//! U+FFFD halves and wrong spaces. [`IncrementalDecoder`] uses the prefix/read-offset technique instead: it keeps
//! a short window of ids, re-decodes it with each new id, and emits only the text beyond what the window's already
//! emitted part decodes to, holding everything back while the text ends in U+FFFD (an incomplete character).

use super::{Tokenizer, TokenizerError};

/// Turns a stream of ids into a stream of complete text pieces, borrowing its tokenizer.
#[derive(Debug)]
pub struct IncrementalDecoder<'a> {
    tok: &'a Tokenizer,
    state: DecodeState,
}

impl<'a> IncrementalDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        IncrementalDecoder { tok, state: DecodeState::new(skip_special) }
    }

    /// Adds one id and returns the text it completes; empty while a character (or a skipped special token)
    /// produces nothing new yet.
    ///
    /// # Errors
    /// As [`DecodeState::push`].
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.state.push(self.tok, id)
    }

    /// Returns whatever is still held back and marks it emitted.
    ///
    /// # Errors
    /// As [`DecodeState::push`].
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        self.state.flush(self.tok)
    }
}

/// The state of a streaming decode, without the tokenizer: what a long-lived sequence keeps (the engine owns
/// one tokenizer for all of them).
#[derive(Clone, Debug)]
pub struct DecodeState {
    skip_special: bool,
    /// The window of ids still needed. `ids[..read_offset]` produced the last emitted piece and only serve as
    /// decoding context (the "prefix"); `ids[read_offset..]` are held back. Older ids are dropped.
    ids: Vec<u32>,
    read_offset: usize,
}

impl DecodeState {
    pub fn new(skip_special: bool) -> Self {
        DecodeState { skip_special, ids: Vec::new(), read_offset: 0 }
    }

    /// Adds one id and returns the text it completes; empty while a character (or a skipped special token)
    /// produces nothing new yet.
    ///
    /// # Errors
    /// `Backend` when decoding fails; `StreamPrefix` when the tokenizer's decoder rewrites already emitted text
    /// (no decoder shipped with supported models does).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let (emitted, full) = self.decode_window(tok)?;
        if full.len() <= emitted.len() || full.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        self.take_new_text(&emitted, &full, id)
    }

    /// Returns whatever is still held back (an incomplete character decodes to U+FFFD here) and marks it emitted.
    ///
    /// # Errors
    /// As [`DecodeState::push`].
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let Some(&last) = self.ids.last() else { return Ok(String::new()) };
        let (emitted, full) = self.decode_window(tok)?;
        if full.len() <= emitted.len() {
            return Ok(String::new());
        }
        self.take_new_text(&emitted, &full, last)
    }

    /// Decodes the context part of the window and the whole window.
    fn decode_window(&self, tok: &Tokenizer) -> Result<(String, String), TokenizerError> {
        let emitted = tok.decode(&self.ids[..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids, self.skip_special)?;
        Ok((emitted, full))
    }

    /// Emits `full` past `emitted` and slides the window: the tokens just emitted become the new context.
    fn take_new_text(&mut self, emitted: &str, full: &str, token_id: u32) -> Result<String, TokenizerError> {
        let new_text = full.strip_prefix(emitted).ok_or(TokenizerError::StreamPrefix { token_id })?.to_string();
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        Ok(new_text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_vocab::{byte_level_tokenizer, byte_token_id};

    fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut dec = IncrementalDecoder::new(tok, skip_special);
        let mut pieces: Vec<String> = ids.iter().map(|&id| dec.push(id).expect("push")).collect();
        pieces.push(dec.flush().expect("flush"));
        pieces
    }

    #[test]
    fn multi_byte_characters_split_across_tokens_are_held_back() {
        let tok = byte_level_tokenizer();
        // "a中😀b" as single-byte tokens: 中 is 3 bytes, 😀 is 4.
        let ids: Vec<u32> = "a中😀b".bytes().map(byte_token_id).collect();
        let pieces = stream(&tok, &ids, false);
        assert_eq!(pieces, ["a", "", "", "中", "", "", "", "😀", "b", ""]);
        assert!(pieces.iter().all(|p| !p.contains(char::REPLACEMENT_CHARACTER)));
    }

    #[test]
    fn concatenation_equals_full_decode() {
        let tok = byte_level_tokenizer();
        for text in ["héllo wörld", "Привет, мир", "<|im_start|>user\nØ<|im_end|>", "  \t\n😀😀"] {
            let ids = tok.encode(text, false).expect("encode");
            for skip in [false, true] {
                let streamed: String = stream(&tok, &ids, skip).concat();
                assert_eq!(streamed, tok.decode(&ids, skip).expect("decode"), "{text:?} skip={skip}");
            }
        }
    }

    #[test]
    fn skipped_special_tokens_produce_nothing() {
        let tok = byte_level_tokenizer();
        let ids = tok.encode("<|im_start|>hi<|im_end|>", false).expect("encode");
        let pieces = stream(&tok, &ids, true);
        assert_eq!(pieces.first().map(String::as_str), Some(""));
        assert_eq!(pieces.concat(), "hi");
    }

    #[test]
    fn an_invalid_byte_followed_by_text_is_emitted_like_decode_does() {
        let tok = byte_level_tokenizer();
        // 0xE4 starts a 3-byte character that never completes.
        let ids = [byte_token_id(0xE4), byte_token_id(b'x')];
        assert_eq!(stream(&tok, &ids, false), ["", "\u{FFFD}x", ""]);
        let mut dec = IncrementalDecoder::new(&tok, false);
        assert_eq!(dec.push(byte_token_id(0xE4)).expect("push"), "");
        assert_eq!(dec.flush().expect("flush"), "\u{FFFD}");
        assert_eq!(dec.flush().expect("flush again"), "");
    }
}
