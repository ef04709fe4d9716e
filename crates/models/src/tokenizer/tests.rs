//! Unit tests of [`Tokenizer`] on the hand-made vocabularies of `test_vocab`.

use std::path::PathBuf;

use super::test_vocab::{byte_char, byte_token_id, vocab, CONTROL_TOKENS, USER_TOKEN};
use super::*;

fn tokenizer(pre: &str) -> Tokenizer {
    Tokenizer::from_gguf(&vocab(Some(pre))).expect("test vocabulary builds")
}

fn id(tok: &Tokenizer, token: &str) -> u32 {
    tok.token_to_id(token).unwrap_or_else(|| panic!("`{token}` is in the test vocabulary"))
}

fn byte_ids(text: &str) -> Vec<u32> {
    text.bytes().map(byte_token_id).collect()
}

#[test]
fn first_word_gets_no_prefix_space() {
    let tok = tokenizer("smollm");
    let ids = tok.encode("hello world", false).expect("encode");
    assert_eq!(ids, [id(&tok, "hello"), id(&tok, "Ġworld")]);
    assert_eq!(tok.decode(&ids, false).expect("decode"), "hello world");
}

#[test]
fn pre_tokenizer_decides_how_digits_split() {
    let ids = |pre: &str, text: &str| tokenizer(pre).encode(text, false).expect("encode");
    let tok = tokenizer("gpt2");
    // GPT-2 keeps a digit run (and its leading space) together, so the merges apply.
    assert_eq!(ids("gpt2", "123"), [id(&tok, "123")]);
    assert_eq!(ids("gpt2", " 1"), [id(&tok, "Ġ1")]);
    // SmolLM and Qwen2 split every digit; the space before a number stays alone.
    assert_eq!(ids("smollm", "123"), byte_ids("123"));
    assert_eq!(ids("smollm", " 1"), byte_ids(" 1"));
    assert_eq!(ids("qwen2", "123"), byte_ids("123"));
    // Llama 3 groups digits by three.
    assert_eq!(ids("llama-bpe", "12345"), [id(&tok, "123"), id(&tok, "45")]);
}

#[test]
fn llama3_takes_whole_words_from_the_vocabulary() {
    // `xyz` has no merges leading to it: only Llama 3's ignore_merges finds it.
    let tok = tokenizer("llama-bpe");
    assert_eq!(tok.encode("xyz", false).expect("encode"), [id(&tok, "xyz")]);
    assert_eq!(tokenizer("gpt2").encode("xyz", false).expect("encode"), byte_ids("xyz"));
}

#[test]
fn qwen2_normalizes_to_nfc() {
    let decomposed = "e\u{301}";
    assert_eq!(tokenizer("qwen2").encode(decomposed, false).expect("encode"), byte_ids("é"));
    assert_eq!(tokenizer("gpt2").encode(decomposed, false).expect("encode"), byte_ids(decomposed));
}

#[test]
fn control_tokens_in_text_map_to_their_ids_and_can_be_skipped() {
    let tok = tokenizer("smollm");
    let text = "<|im_start|>hello<|im_end|>";
    let ids = tok.encode(text, false).expect("encode");
    assert_eq!(ids, [1, id(&tok, "hello"), 2]);
    assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "hello");
}

#[test]
fn user_defined_tokens_match_but_are_not_special() {
    let tok = tokenizer("qwen2");
    let ids = tok.encode("<think>hello", false).expect("encode");
    assert_eq!(ids, [3, id(&tok, "hello")]);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "<think>hello");
}

#[test]
fn multilingual_text_round_trips_through_bytes() {
    let tok = tokenizer("smollm");
    for text in ["Привет 中文 😀 مرحبا", "tabs\tand\n\nnewlines   ", " leading and trailing "] {
        let ids = tok.encode(text, false).expect("encode");
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }
    // Each byte of a character not covered by merges is its own token.
    assert_eq!(tok.encode("中", false).expect("encode"), byte_ids("中"));
}

#[test]
fn bos_is_prepended_only_when_asked_for_and_not_doubled() {
    let mut v = vocab(Some("smollm"));
    v.add_bos = true;
    let tok = Tokenizer::from_gguf(&v).expect("builds");
    assert_eq!(tok.encode("hello", true).expect("encode"), [1, id(&tok, "hello")]);
    assert_eq!(tok.encode("hello", false).expect("encode"), [id(&tok, "hello")]);
    assert_eq!(tok.encode("<|im_start|>hello", true).expect("encode"), [1, id(&tok, "hello")]);
    assert_eq!(tokenizer("smollm").encode("hello", true).expect("encode"), [id(&tok, "hello")]);
}

#[test]
fn accessors_report_the_gguf_metadata() {
    let mut v = vocab(Some("smollm"));
    v.chat_template = Some("{{ bos_token }}|{{ eos_token }}".into());
    let tok = Tokenizer::from_gguf(&v).expect("builds");
    assert_eq!(tok.vocab_size(), v.tokens.len());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), [2]);
    assert_eq!(tok.id_to_token(byte_token_id(b' ')), Some(byte_char(b' ').to_string()));
    assert_eq!(tok.id_to_token(2).as_deref(), Some(CONTROL_TOKENS[2]));
    assert_eq!(tok.token_to_id(USER_TOKEN), Some(3));
    let rendered =
        tok.chat_template().expect("has a template").render::<super::ChatMessage>(&[], false, &serde_json::Value::Null);
    assert_eq!(rendered.expect("renders"), "<|im_start|>|<|im_end|>");
}

#[test]
fn invalid_vocabularies_are_rejected() {
    let mut v = vocab(None);
    v.model = "llama".into();
    assert!(matches!(Tokenizer::from_gguf(&v), Err(TokenizerError::UnsupportedModel(m)) if m == "llama"));
    let mut v = vocab(None);
    v.pre = Some("unknown-pre".into());
    assert!(matches!(Tokenizer::from_gguf(&v), Err(TokenizerError::UnsupportedPreTokenizer(_))));
    let mut v = vocab(None);
    v.token_types.pop();
    assert!(matches!(Tokenizer::from_gguf(&v), Err(TokenizerError::InvalidVocab(_))));
    let mut v = vocab(None);
    v.merges.push("q zz".into());
    assert!(matches!(Tokenizer::from_gguf(&v), Err(TokenizerError::InvalidVocab(_))));
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dflash-tokenizer-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn hf_directory_supplies_special_tokens_template_and_generation_eos() {
    let dir = TempDir::new("hf");
    let source = Tokenizer::from_gguf(&vocab(Some("smollm"))).expect("builds");
    source.inner.save(dir.0.join("tokenizer.json"), false).expect("save tokenizer.json");
    let config = serde_json::json!({
        "bos_token": {"content": "<|im_start|>", "lstrip": false},
        "eos_token": "<|im_end|>",
        "add_bos_token": true,
        "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
    });
    std::fs::write(dir.0.join("tokenizer_config.json"), config.to_string()).expect("write config");
    std::fs::write(dir.0.join("generation_config.json"), r#"{"eos_token_id": [2, 0]}"#).expect("write gen config");

    let tok = Tokenizer::from_hf_dir(&dir.0).expect("loads");
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), [2, 0]);
    assert_eq!(tok.vocab_size(), source.vocab_size());
    assert_eq!(
        tok.encode("hello world", true).expect("encode"),
        source.encode("<|im_start|>hello world", false).expect("encode")
    );
    let template = tok.chat_template().expect("template");
    let rendered = template.render(&[ChatMessage::new("user", "x")], false, &serde_json::Value::Null).expect("renders");
    assert_eq!(rendered, "<|im_start|>x<|im_end|>");

    // A chat_template.jinja file wins over the config's template, as in transformers.
    std::fs::write(dir.0.join("chat_template.jinja"), "jinja:{{ messages | length }}").expect("write template");
    let tok = Tokenizer::from_hf_dir(&dir.0).expect("loads");
    let rendered =
        tok.chat_template().expect("template").render::<super::ChatMessage>(&[], false, &serde_json::Value::Null);
    assert_eq!(rendered.expect("renders"), "jinja:0");
}

#[test]
fn hf_directory_without_tokenizer_json_is_an_io_error() {
    let dir = TempDir::new("empty");
    assert!(matches!(Tokenizer::from_hf_dir(&dir.0), Err(TokenizerError::Io { .. })));
}

/// Random text of every kind (control characters, NUL, tabs, digits, Cyrillic, CJK, emoji, combining and
/// direction marks, control tokens) round-trips through encode and decode for the byte-level pre-tokenizers, and
/// decoding any ids in the vocabulary never panics. Fixed seed, 2,000 texts.
#[test]
fn any_text_round_trips_and_any_ids_decode() {
    const PIECES: [&str; 16] = [
        "a",
        " ",
        "  ",
        "\t",
        "\n",
        "\0",
        "\u{7f}",
        "7",
        "42",
        "Привет",
        "中文",
        "😀",
        "e\u{301}",
        "\u{202e}",
        "!?",
        "<|im_start|>",
    ];
    let mut state = 11u64;
    let mut below = |n: usize| {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (state ^ (state >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((z ^ (z >> 31)) % n as u64) as usize
    };
    for pre in ["smollm", "llama3"] {
        let tok = tokenizer(pre);
        for _ in 0..1000 {
            let text: String = (0..below(12)).map(|_| PIECES[below(PIECES.len())]).collect();
            let ids = tok.encode(&text, false).unwrap_or_else(|e| panic!("{pre}: encode {text:?}: {e}"));
            assert_eq!(tok.decode(&ids, false).expect("decode"), text, "{pre}: {ids:?}");
            let vocab = tok.vocab_size() as u32;
            let random: Vec<u32> = (0..below(8)).map(|_| below(vocab as usize) as u32).collect();
            let _ = tok.decode(&random, below(2) == 0);
        }
    }
}

/// Random conversations (every role, text with template syntax, control tokens, multi-byte characters, empty
/// messages) through a ChatML template with a tools section: rendering never panics, and every message's content
/// comes out verbatim: a message is data, never template code (`{{ 7 * 7 }}` stays as written). Fixed seed.
#[test]
fn any_conversation_renders_with_its_content_verbatim() {
    const TEMPLATE: &str = "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}\
        {% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    const PIECES: [&str; 14] = [
        "hi",
        " ",
        "\n",
        "{{ 7 * 7 }}",
        "{% for x in y %}",
        "{#",
        "}}",
        "<|im_end|>",
        "Привет",
        "😀",
        "\0",
        "\"'",
        "\\",
        "",
    ];
    const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
    let template = super::ChatTemplate::new(TEMPLATE, None, None).expect("compiles");
    let mut state = 5u64;
    let mut below = |n: usize| {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (state ^ (state >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((z ^ (z >> 31)) % n as u64) as usize
    };
    for _ in 0..500 {
        let messages: Vec<super::ChatMessage> = (0..below(6))
            .map(|_| {
                let content: String = (0..below(6)).map(|_| PIECES[below(PIECES.len())]).collect();
                super::ChatMessage::new(ROLES[below(ROLES.len())], content)
            })
            .collect();
        let tools =
            if below(2) == 0 { serde_json::json!({"tools": [{"name": "{{ f }}"}]}) } else { serde_json::json!({}) };
        let text = template.render(&messages, below(2) == 0, &tools).expect("renders");
        for message in &messages {
            let block = format!("<|im_start|>{}\n{}<|im_end|>", message.role, message.content);
            assert!(text.contains(&block), "{block:?} not verbatim in {text:?}");
        }
    }
}
