//! Small hand-made byte-level BPE vocabularies for unit tests.
//!
//! Layout: ids 0..=2 control tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`), id 3 the user-defined
//! `<think>`, ids 4..260 the 256 byte-level characters in byte order, then one token per merge, then `xyz`
//! (in the vocabulary but unreachable through merges).

use super::{GgufVocab, Tokenizer};

pub(crate) const CONTROL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub(crate) const USER_TOKEN: &str = "<think>";
const FIRST_BYTE_ID: u32 = 4;

/// Merges in priority order; each adds the concatenated token to the vocabulary.
const MERGES: [&str; 13] =
    ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "12 3", "4 5", "Ġ 1"];

/// The GPT-2 byte-to-character table: printable Latin-1 bytes stand for themselves, the others are shifted to
/// U+0100 and up in byte order.
pub(crate) fn byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
}

pub(crate) fn byte_token_id(b: u8) -> u32 {
    FIRST_BYTE_ID + u32::from(b)
}

/// The test vocabulary with the given `tokenizer.ggml.pre`.
pub(crate) fn vocab(pre: Option<&str>) -> GgufVocab {
    let mut tokens: Vec<String> = CONTROL_TOKENS.iter().map(|t| t.to_string()).collect();
    let mut token_types = vec![3; CONTROL_TOKENS.len()];
    tokens.push(USER_TOKEN.to_string());
    token_types.push(4);
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        token_types.push(1);
    }
    for merge in MERGES {
        tokens.push(merge.replace(' ', ""));
        token_types.push(1);
    }
    tokens.push("xyz".to_string());
    token_types.push(1);
    GgufVocab {
        model: "gpt2".into(),
        pre: pre.map(str::to_string),
        tokens,
        token_types,
        merges: MERGES.iter().map(|m| m.to_string()).collect(),
        bos_id: Some(1),
        eos_id: Some(2),
        add_bos: false,
        add_space_prefix: false,
        chat_template: None,
    }
}

/// The SmolLM-style (`pre = smollm`) test tokenizer.
pub(crate) fn byte_level_tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&vocab(Some("smollm"))).expect("test vocabulary builds")
}
