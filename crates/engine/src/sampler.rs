//! Token selection: greedy argmax, or keyed Gumbel-max sampling after penalties, temperature,
//! top-k, top-p and min-p.
//!
//! Every random draw is a pure function of (seed, absolute position, token id, stream). A seeded
//! request therefore yields the same tokens whatever else shares its batch, in whatever order
//! positions are sampled, and whether or not speculative decoding ran: the verifier can recompute
//! exactly the draw the plain decoder would have made at that position.

use std::collections::{HashMap, HashSet};

use dflash_models::GenerationDefaults;

use dflash_runtime::ops::filter::{argmax, filter_ids, softmax};
use dflash_runtime::ops::sample::{self as keyed, AdjustKind, Adjustment, Draw, GREEDY_TEMPERATURE};
pub use dflash_runtime::ops::sample::{
    gumbel, keyed_uniform, log_softmax, logprobs_top, mix64, top_n, STREAM_DRAFT, STREAM_TARGET,
};

/// Why a [`SamplingParams`] was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("{name} must be in {range}, got {value}")]
    OutOfRange { name: &'static str, range: &'static str, value: f32 },
}

/// How a request wants its tokens chosen. Neutral values switch a stage off.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 (or below 1e-5) means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose mass reaches top_p; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one; 0 = off.
    pub min_p: f32,
    /// HF semantics over prompt and generated tokens: positive logits divided, negative multiplied;
    /// 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI semantics over generated tokens: subtracted once from every token generated so far.
    pub presence_penalty: f32,
    /// OpenAI semantics over generated tokens: subtracted once per occurrence.
    pub frequency_penalty: f32,
    pub seed: u64,
    /// OpenAI's `logit_bias`: `(token id, bias)` pairs, added to the raw logits before every other stage (penalties,
    /// temperature, filters), for every row the request samples or verifies. Biases lie in [-100, 100]; ids past
    /// the vocabulary are ignored here (the HTTP layer refuses them).
    pub logit_bias: Vec<(u32, f32)>,
}

/// The sampling fields a caller set, `None` where it left them to the defaults: what an HTTP body or the command
/// line asked for, before [`SamplingParams::resolve`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingChoices {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// `(token id, bias)` pairs; empty: no bias.
    pub logit_bias: Vec<(u32, f32)>,
}

/// What a field becomes when neither the caller nor the model's generation config sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// OpenAI's API defaults, temperature 1 and every other stage off: what OpenAI clients sending requests over
    /// HTTP expect.
    OpenAi,
    /// Greedy decoding: `dflash run` gives the same answer every time unless asked to sample.
    Greedy,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Argmax decoding with every other stage off.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }

    /// The one place sampling defaults are merged: each field is the caller's choice, else the model's generation
    /// config, else `fallback`'s; a request without a seed gets a random one (its draws are its own, as OpenAI's are
    /// without a seed); then every field is checked, once.
    ///
    /// # Errors
    /// [`SamplerError::OutOfRange`] naming the first field outside its range.
    pub fn resolve(
        choices: &SamplingChoices,
        model: &GenerationDefaults,
        fallback: Fallback,
    ) -> Result<Self, SamplerError> {
        let base = match fallback {
            Fallback::OpenAi => SamplingParams { temperature: 1.0, ..Self::greedy() },
            Fallback::Greedy => Self::greedy(),
        };
        let params = SamplingParams {
            temperature: choices.temperature.or(model.temperature).unwrap_or(base.temperature),
            top_k: choices.top_k.or(model.top_k).unwrap_or(base.top_k),
            top_p: choices.top_p.or(model.top_p).unwrap_or(base.top_p),
            min_p: choices.min_p.or(model.min_p).unwrap_or(base.min_p),
            repetition_penalty: choices
                .repetition_penalty
                .or(model.repetition_penalty)
                .unwrap_or(base.repetition_penalty),
            presence_penalty: choices.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: choices.frequency_penalty.unwrap_or(base.frequency_penalty),
            seed: choices.seed.unwrap_or_else(random_seed),
            logit_bias: choices.logit_bias.clone(),
        };
        params.validate()?;
        Ok(params)
    }

    /// Whether tokens are chosen by argmax (temperature 0, or too small to divide by).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_TEMPERATURE
    }

    /// Checks every field against its OpenAI-style range.
    ///
    /// # Errors
    /// [`SamplerError::OutOfRange`] naming the first field outside its range (NaN is outside every
    /// range).
    pub fn validate(&self) -> Result<(), SamplerError> {
        let closed = |v: f32, lo: f32, hi: f32| (lo..=hi).contains(&v);
        let half_open = |v: f32, lo: f32, hi: f32| v > lo && v <= hi;
        let (t, rep) = (self.temperature, self.repetition_penalty);
        check("temperature", t, "[0, 2]", closed(t, 0.0, 2.0))?;
        check("top_p", self.top_p, "(0, 1]", half_open(self.top_p, 0.0, 1.0))?;
        check("min_p", self.min_p, "[0, 1]", closed(self.min_p, 0.0, 1.0))?;
        check("repetition_penalty", rep, "(0, 10]", half_open(rep, 0.0, 10.0))?;
        for (name, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            check(name, value, "[-2, 2]", closed(value, -2.0, 2.0))?;
        }
        for &(_, bias) in &self.logit_bias {
            check("logit_bias", bias, "[-100, 100]", closed(bias, -100.0, 100.0))?;
        }
        Ok(())
    }

    /// Whether the token is always the argmax of the raw logits (greedy, no penalty, no bias): all a step needs
    /// back.
    pub fn picks_argmax(&self) -> bool {
        self.is_greedy() && !self.has_penalties() && self.logit_bias.is_empty()
    }

    pub(crate) fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// The draw this request makes at absolute position `pos` (its noise's key).
    pub fn draw(&self, pos: u64) -> Draw {
        let (temperature, top_k, top_p, min_p) = (self.temperature, self.top_k, self.top_p, self.min_p);
        Draw { temperature, top_k, top_p, min_p, seed: self.seed, position: pos }
    }

    /// The changes to single raw logits this request makes after `history`: its logit bias in order, then the
    /// repetition penalty over every token seen (HF), then presence and frequency over the generated ones (OpenAI),
    /// the penalties only when some token has been seen. Empty when none applies.
    pub fn adjustments(&self, history: &TokenHistory) -> Vec<Adjustment> {
        let bias = self.logit_bias.iter().map(|&(id, value)| Adjustment { id, kind: AdjustKind::Add, value });
        let mut out: Vec<Adjustment> = bias.collect();
        let seen = !(history.prompt.is_empty() && history.generated.is_empty());
        if !self.has_penalties() || !seen {
            return out;
        }
        let penalty = self.repetition_penalty;
        if penalty != 1.0 {
            out.extend(history.seen_ids().map(|id| Adjustment { id, kind: AdjustKind::Repeat, value: penalty }));
        }
        let (presence, frequency) = (self.presence_penalty, self.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            out.extend(history.generated_counts.iter().map(|(&id, &count)| Adjustment {
                id,
                kind: AdjustKind::Add,
                value: -(presence + frequency * count as f32),
            }));
        }
        out
    }
}

/// A seed for a request that brings none: from the process's random hasher keys and the clock.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// `Ok` when `in_range`, else the error naming the field.
fn check(name: &'static str, value: f32, range: &'static str, in_range: bool) -> Result<(), SamplerError> {
    if in_range {
        Ok(())
    } else {
        Err(SamplerError::OutOfRange { name, range, value })
    }
}

/// The tokens a sequence has seen, for penalties: the prompt's distinct ids (repetition penalty
/// only) and the generated ids with their counts (repetition, presence and frequency penalties).
#[derive(Clone, Debug, Default)]
pub struct TokenHistory {
    prompt: HashSet<u32>,
    generated: Vec<u32>,
    generated_counts: HashMap<u32, u32>,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> Self {
        TokenHistory { prompt: prompt.iter().copied().collect(), ..Self::default() }
    }

    /// Records one generated token.
    pub fn push(&mut self, id: u32) {
        self.generated.push(id);
        *self.generated_counts.entry(id).or_insert(0) += 1;
    }

    /// Rolls back to the first `n_generated` generated tokens (rejected speculation); no-op if
    /// fewer exist.
    pub fn truncate_generated(&mut self, n_generated: usize) {
        while self.generated.len() > n_generated {
            let Some(id) = self.generated.pop() else {
                break;
            };
            if let Some(count) = self.generated_counts.get_mut(&id) {
                *count -= 1;
                if *count == 0 {
                    self.generated_counts.remove(&id);
                }
            }
        }
    }

    /// The generated tokens, oldest first.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Distinct ids in prompt or output, each once.
    fn seen_ids(&self) -> impl Iterator<Item = u32> + '_ {
        let generated_only = self.generated_counts.keys().filter(|id| !self.prompt.contains(id));
        self.prompt.iter().chain(generated_only).copied()
    }
}

/// The candidate set left after penalties, temperature, top-k, top-p and min-p, in ascending id
/// order.
///
/// For greedy params the set is the argmax alone, with its penalised (unscaled) logit and
/// probability 1.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    pub ids: Vec<u32>,
    /// Penalised logits divided by the temperature.
    pub logits: Vec<f32>,
    /// Softmax of `logits` over the set.
    pub probs: Vec<f32>,
}

impl Candidates {
    /// The probability of `id` under this distribution (0 outside the set).
    pub fn prob_of(&self, id: u32) -> f32 {
        self.ids.binary_search(&id).map_or(0.0, |i| self.probs[i])
    }
}

/// The filtered, renormalised distribution the sampler draws from (see [`Candidates`]).
///
/// Stages run in this order: logit bias and penalties on the raw logits, division by the temperature, top-k,
/// top-p, min-p. Masked tokens (logit -inf or NaN) are never candidates unless every token is
/// masked, in which case the argmax stands alone.
pub fn candidates(logits: &[f32], params: &SamplingParams, history: &TokenHistory) -> Candidates {
    let adjust = params.adjustments(history);
    if params.is_greedy() {
        let penalized = keyed::adjusted(logits, &adjust);
        let id = argmax(&penalized);
        let logit = penalized.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
        return Candidates { ids: vec![id], logits: vec![logit], probs: vec![1.0] };
    }
    let scaled = keyed::scaled(logits, params.temperature, &adjust);
    let mut ids = filter_ids(&scaled, params.top_k, params.top_p, params.min_p);
    if ids.is_empty() {
        ids.push(argmax(&scaled));
    }
    let set_logits: Vec<f32> = ids.iter().map(|&id| scaled[id as usize]).collect();
    let probs = softmax(&set_logits);
    Candidates { ids, logits: set_logits, probs }
}

/// The token at absolute position `pos`.
///
/// Greedy: argmax of the penalised logits, ties to the lowest id. Otherwise Gumbel-max over
/// [`candidates`]: argmax over the set of `logit_i / T + gumbel(keyed_uniform(seed, pos, id_i,
/// STREAM_TARGET))`, ties to the lowest id — a draw from the candidates' softmax that depends only
/// on the key, not on the call ([`keyed::draw_token`], which a device target runs as its twin).
pub fn sample(logits: &[f32], params: &SamplingParams, history: &TokenHistory, pos: u64) -> u32 {
    keyed::draw_token(logits, &params.draw(pos), &params.adjustments(history))
}

#[cfg(test)]
mod tests;
