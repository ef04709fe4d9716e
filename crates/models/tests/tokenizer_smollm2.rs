//! The SmolLM2 tokenizer built from the default GGUF model against golden ids and chat renderings from
//! tools/golden/tokenizer_ids.py (fixtures/tokenizer/smollm2_ids.json). Skipped, with a message, when the model
//! file has not been downloaded.

use std::path::PathBuf;
use std::sync::OnceLock;

use dflash_models::gguf::GgufFile;
use dflash_models::tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    model_file: String,
    vocab_size: usize,
    bos_id: u32,
    eos_id: u32,
    add_bos: bool,
    texts: Vec<TextCase>,
    chat: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct TextCase {
    text: String,
    ids: Vec<u32>,
    decoded_skip_special: String,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
    ids: Vec<u32>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/smollm2_ids.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
    })
}

/// The tokenizer of the default model (fetched on first use, like the binary does).
fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = dflash_models::resolve::ensure_default_model().expect("default model");
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        assert_eq!(name.as_deref(), Some(fixture().model_file.as_str()), "fixture is for another model");
        let vocab = GgufFile::open(&path).expect("open GGUF").tokenizer_vocab().expect("tokenizer vocab");
        Tokenizer::from_gguf(&vocab).expect("build tokenizer")
    })
}

#[test]
fn metadata_matches_the_gguf() {
    let tok = tokenizer();
    let f = fixture();
    assert_eq!(tok.vocab_size(), f.vocab_size);
    assert_eq!(tok.bos_id(), Some(f.bos_id));
    assert_eq!(tok.eos_ids(), [f.eos_id]);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(f.eos_id));
    assert_eq!(tok.id_to_token(f.bos_id).as_deref(), Some("<|im_start|>"));
    // SmolLM2 adds no BOS, so add_special must not change the ids.
    assert!(!f.add_bos);
    assert_eq!(tok.encode("Hello", true).expect("encode"), tok.encode("Hello", false).expect("encode"));
}

#[test]
fn encode_matches_golden_ids() {
    let tok = tokenizer();
    for case in &fixture().texts {
        assert_eq!(tok.encode(&case.text, false).expect("encode"), case.ids, "text {:?}", case.text);
    }
}

#[test]
fn decode_round_trips_and_skips_control_tokens() {
    let tok = tokenizer();
    for case in &fixture().texts {
        assert_eq!(tok.decode(&case.ids, false).expect("decode"), case.text);
        assert_eq!(tok.decode(&case.ids, true).expect("decode"), case.decoded_skip_special, "text {:?}", case.text);
    }
}

#[test]
fn chat_template_renders_like_transformers() {
    let tok = tokenizer();
    let template = tok.chat_template().expect("the GGUF has a chat template");
    for case in &fixture().chat {
        let rendered =
            template.render(&case.messages, case.add_generation_prompt, &serde_json::Value::Null).expect("render");
        assert_eq!(rendered, case.rendered);
        assert_eq!(tok.encode(&rendered, false).expect("encode"), case.ids);
    }
}

/// Streams `ids` through an [`IncrementalDecoder`]; returns the pieces, the final flush last.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut decoder = IncrementalDecoder::new(tok, skip_special);
    let mut pieces: Vec<String> = ids.iter().map(|&id| decoder.push(id).expect("push")).collect();
    pieces.push(decoder.flush().expect("flush"));
    pieces
}

#[test]
fn incremental_decoding_concatenates_to_decode_without_replacement_characters() {
    let tok = tokenizer();
    for case in &fixture().texts {
        for skip_special in [false, true] {
            let pieces = stream(tok, &case.ids, skip_special);
            let whole = tok.decode(&case.ids, skip_special).expect("decode");
            assert_eq!(pieces.concat(), whole, "text {:?} skip_special={skip_special}", case.text);
            let broken = pieces.iter().find(|p| p.contains(char::REPLACEMENT_CHARACTER));
            assert_eq!(broken, None, "text {:?} streamed half a character", case.text);
        }
    }
}

#[test]
fn characters_split_across_byte_level_tokens_are_emitted_whole() {
    let tok = tokenizer();
    for text in ["😀", "你好，世界！", "👨‍👩‍👧 ok"] {
        let ids = tok.encode(text, false).expect("encode");
        // The vocabulary has no single token for these characters: decoding token by token breaks them.
        let naive: String = ids.iter().map(|&id| tok.decode(&[id], false).expect("decode")).collect();
        assert!(naive.contains(char::REPLACEMENT_CHARACTER), "{text:?} is not split across tokens: {ids:?}");
        let pieces = stream(tok, &ids, false);
        assert!(pieces.iter().any(String::is_empty), "{text:?}: nothing was held back");
        assert!(pieces.iter().all(|p| !p.contains(char::REPLACEMENT_CHARACTER)), "{text:?}: {pieces:?}");
        assert_eq!(pieces.concat(), text);
    }
    let pieces = stream(tok, &tok.encode("😀", false).expect("encode"), false);
    assert_eq!(pieces.iter().filter(|p| !p.is_empty()).collect::<Vec<_>>(), ["😀"]);
}
