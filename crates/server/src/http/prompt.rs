//! Prompts that take more than one template render or tokenization: a chat whose final message the model continues
//! (`continue_final_message`), and fill-in-the-middle (`suffix` on completions).

use super::engine::EngineHandle;
use super::errors::ApiError;
use super::types::{ChatMessageIn, Role};
use super::validate::PromptSource;

/// The fill-in-the-middle tokens, in prompt order: `<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>`, the
/// StarCoder format SmolLM2 and Qwen2.5-Coder tokenizers share.
pub(crate) const FIM_TOKENS: [&str; 3] = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"];

/// The conversation rendered with its final message left open: no end-of-turn after it and no new turn, so the
/// model continues the message (transformers' and vLLM's `continue_final_message`). The template renders the whole
/// conversation; the text is cut right after the last occurrence of the final message's content. A final assistant
/// message with no content has nothing to continue: the model starts that turn as with `add_generation_prompt`.
///
/// # Errors
/// 400 [`ApiError`] naming `continue_final_message` when the rendered text does not hold the final message (a
/// template that rewrites or drops it), or the final message is empty and not the assistant's.
pub(crate) fn continued_chat_text(
    engine: &dyn EngineHandle,
    messages: &[ChatMessageIn],
    kwargs: &serde_json::Value,
) -> Result<String, ApiError> {
    let Some((last, earlier)) = messages.split_last() else {
        return Err(ApiError::invalid_param("messages", "`messages` must not be empty."));
    };
    if last.content.trim().is_empty() {
        if last.role != Role::Assistant {
            return Err(ApiError::invalid_param(
                "continue_final_message",
                "`continue_final_message` needs a final message with content, or an empty assistant message.",
            ));
        }
        return engine.apply_chat_template(earlier, true, kwargs);
    }
    let rendered = engine.apply_chat_template(messages, false, kwargs)?;
    cut_after_final(&rendered, &last.content).ok_or_else(|| {
        ApiError::invalid_param(
            "continue_final_message",
            "`continue_final_message` is set but the chat template does not render the final message as sent.",
        )
    })
}

/// `rendered` up to the end of the last occurrence of `content`; its trailing whitespace is kept only where the
/// template kept it (transformers' rule). `None` when `content` (trimmed) does not occur.
fn cut_after_final(rendered: &str, content: &str) -> Option<String> {
    let trimmed = content.trim();
    let start = rendered.rfind(trimmed)?;
    let leading_trimmed = content.trim_start();
    let end = if rendered[start..].starts_with(leading_trimmed) {
        start + leading_trimmed.len()
    } else {
        start + trimmed.len()
    };
    Some(rendered[..end].to_string())
}

/// The fill-in-the-middle prompt around `prefix` (already tokenized, without special tokens) and `suffix`.
///
/// # Errors
/// 400 [`ApiError`] naming `suffix` when the model's vocabulary has no fill-in-the-middle tokens.
pub(crate) fn infill_ids(engine: &dyn EngineHandle, prefix: Vec<u32>, suffix: &str) -> Result<Vec<u32>, ApiError> {
    let [Some(open), Some(hole), Some(middle)] = FIM_TOKENS.map(|token| engine.token_id(token)) else {
        return Err(ApiError::invalid_param(
            "suffix",
            format!(
                "`suffix` needs a fill-in-the-middle format, and this model's vocabulary has none ({}).",
                FIM_TOKENS.join(", ")
            ),
        ));
    };
    let suffix_ids = engine.tokenize(suffix, false)?;
    let mut ids = Vec::with_capacity(prefix.len() + suffix_ids.len() + 3);
    ids.push(open);
    ids.extend(prefix);
    ids.push(hole);
    ids.extend(suffix_ids);
    ids.push(middle);
    Ok(ids)
}

/// The prompt's text as `echo` shows it: the text sent, or the token ids detokenized (for fill-in-the-middle, the
/// prefix).
///
/// # Errors
/// 400 [`ApiError`] for token ids outside the vocabulary; chat prompts have no echo.
pub(crate) fn echo_text(engine: &dyn EngineHandle, prompt: &PromptSource) -> Result<String, ApiError> {
    match prompt {
        PromptSource::Text { text, .. } => Ok(text.clone()),
        PromptSource::Ids(ids) => engine.detokenize(ids),
        PromptSource::Infill { prefix, .. } => echo_text(engine, prefix),
        PromptSource::Chat { .. } | PromptSource::ContinueChat { .. } => {
            Err(ApiError::invalid_param("echo", "`echo` applies to completions only."))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_keeps_the_final_message_open() {
        let rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is<|im_end|>\n";
        let expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is";
        assert_eq!(cut_after_final(rendered, "The answer is").as_deref(), Some(expected));
    }

    #[test]
    fn the_cut_takes_the_last_occurrence() {
        let rendered = "[U]yes[A]yes[end]";
        assert_eq!(cut_after_final(rendered, "yes").as_deref(), Some("[U]yes[A]yes"));
    }

    #[test]
    fn trailing_space_stays_only_where_the_template_kept_it() {
        assert_eq!(cut_after_final("[A]Sure, [end]", "Sure, ").as_deref(), Some("[A]Sure, "));
        assert_eq!(cut_after_final("[A]Sure,[end]", "Sure, ").as_deref(), Some("[A]Sure,"));
        assert_eq!(cut_after_final("[A]Sure,[end]", "  Sure,").as_deref(), Some("[A]Sure,"));
    }

    #[test]
    fn a_message_the_template_rewrote_is_not_found() {
        assert_eq!(cut_after_final("[A]SURE[end]", "sure"), None);
    }
}
