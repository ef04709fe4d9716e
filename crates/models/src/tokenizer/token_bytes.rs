//! What each token id stands for as raw bytes: the alphabet a grammar engine matches tokens against.
//!
//! Byte-level BPE stores bytes as printable characters (GPT-2's table: `Ġ` is a space); SentencePiece-style vocabularies
//! store `▁` for a space and `<0xNN>` for raw bytes. Decoding ids one at a time would lose the bytes of tokens that hold
//! part of a multi-byte character, so the stored token strings are mapped back to bytes directly.

use std::collections::HashMap;

use tokenizers::DecoderWrapper;

use super::Tokenizer;

/// One token's meaning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenPiece {
    /// An ordinary token: the bytes it adds to the text.
    Bytes(Vec<u8>),
    /// A special (control) token such as `<|im_end|>`, by name: it stands for no text.
    Special(String),
}

/// How stored token strings encode bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Alphabet {
    /// GPT-2's byte-to-character table.
    ByteLevel,
    /// `▁` for a space, `<0xNN>` for a raw byte, anything else as UTF-8.
    Metaspace,
}

impl Tokenizer {
    /// Every id's [`TokenPiece`], indexed by id (`[vocab_size]`); ids the vocabulary skips are empty byte strings.
    pub fn token_pieces(&self) -> Vec<TokenPiece> {
        let alphabet = alphabet(self.inner.get_decoder());
        let byte_of_char = byte_level_table();
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size as u32)
            .map(|id| match added.get(&id) {
                Some(token) if token.special => TokenPiece::Special(token.content.clone()),
                Some(token) => TokenPiece::Bytes(token.content.as_bytes().to_vec()),
                None => {
                    let stored = self.inner.id_to_token(id).unwrap_or_default();
                    TokenPiece::Bytes(stored_bytes(&stored, alphabet, &byte_of_char))
                }
            })
            .collect()
    }
}

fn alphabet(decoder: Option<&DecoderWrapper>) -> Alphabet {
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => Alphabet::ByteLevel,
        Some(DecoderWrapper::Sequence(seq)) => {
            let byte_level = seq.get_decoders().iter().any(|d| matches!(d, DecoderWrapper::ByteLevel(_)));
            if byte_level {
                Alphabet::ByteLevel
            } else {
                Alphabet::Metaspace
            }
        }
        _ => Alphabet::Metaspace,
    }
}

/// A stored token string back to its bytes.
fn stored_bytes(stored: &str, alphabet: Alphabet, byte_of_char: &HashMap<char, u8>) -> Vec<u8> {
    match alphabet {
        Alphabet::ByteLevel => stored.chars().filter_map(|c| byte_of_char.get(&c).copied()).collect(),
        Alphabet::Metaspace => match raw_byte(stored) {
            Some(byte) => vec![byte],
            None => stored.replace('▁', " ").into_bytes(),
        },
    }
}

/// `<0xNN>` to the byte `NN`.
fn raw_byte(stored: &str) -> Option<u8> {
    let hex = stored.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// GPT-2's table: printable bytes stand for themselves, the others map in order to the characters from U+0100 on.
fn byte_level_table() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut table = HashMap::with_capacity(256);
    for byte in 0..=255u8 {
        let c = if printable(byte) {
            char::from(byte)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        table.insert(c, byte);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_with_the_known_space() {
        let table = byte_level_table();
        assert_eq!(table.len(), 256);
        assert_eq!(table[&'Ġ'], b' ');
        assert_eq!(table[&'Ċ'], b'\n');
        assert_eq!(table[&'a'], b'a');
    }

    #[test]
    fn metaspace_pieces_map_spaces_and_raw_bytes() {
        let table = byte_level_table();
        assert_eq!(stored_bytes("▁the", Alphabet::Metaspace, &table), b" the");
        assert_eq!(stored_bytes("<0x0A>", Alphabet::Metaspace, &table), b"\n");
        assert_eq!(stored_bytes("<0xZZ>", Alphabet::Metaspace, &table), b"<0xZZ>");
    }

    #[test]
    fn every_ordinary_token_decodes_to_its_bytes() {
        let tok = super::super::test_vocab::byte_level_tokenizer();
        let pieces = tok.token_pieces();
        assert_eq!(pieces.len(), tok.vocab_size());
        for (id, piece) in pieces.iter().enumerate() {
            match piece {
                TokenPiece::Special(name) => assert_eq!(tok.id_to_token(id as u32).as_deref(), Some(name.as_str())),
                TokenPiece::Bytes(bytes) => match std::str::from_utf8(bytes) {
                    Ok(text) => assert_eq!(tok.decode(&[id as u32], false).expect("decodes"), text, "token {id}"),
                    // A lone byte of a multi-byte character: the byte itself, which decoding would lose.
                    Err(_) => assert_eq!(bytes.len(), 1, "token {id}"),
                },
            }
        }
        assert_eq!(pieces[0], TokenPiece::Special("<|endoftext|>".into()));
        assert_eq!(pieces[3], TokenPiece::Bytes(b"<think>".to_vec()));
    }
}
