//! Keyed token draws where the logits are: `sample_rows` (kernels/sample.cu), the device twin of
//! [`crate::ops::sample::draw_rows`]. A step uploads its rows and their adjustments as one block of words
//! ([`pack_draws`]), one block per row draws its token (and logprobs when asked) from the logits in device memory,
//! and [`unpack_drawn`] reads the results back from [`DRAWN_WORDS`] words a row.

use super::{dim, launch_cfg, launch_err, shape_err};
use crate::cuda::device::{CudaDevice, DeviceBuf};
use crate::cuda::view::DevArg;
use crate::cuda::Result;
use crate::ops::sample::{AdjustKind, Adjustment, DrawRow, Drawn, MAX_TOP_LOGPROBS};

/// u32 words per row in pack_draws' output (the `packed` input of [`sample_rows`]).
///
/// A row's words in [`pack_draws`]: logit row, adjustment range start and end, top logprobs (`u32::MAX` for
/// none), temperature, top-k, top-p, min-p, ln(min-p) (f32 bits, as the host rounds it), seed and position
/// (low word first); the rest are zero. `SAMPLE_DRAW_WORDS` in sample.cu.
pub const DRAW_WORDS: usize = 16;

/// u32 words per row of sample_rows' output: id, logprob bits, top ids (`u32::MAX` past the last), top logprob
/// bits. `SAMPLE_DRAWN_WORDS` in sample.cu.
pub const DRAWN_WORDS: usize = 2 + 2 * MAX_TOP_LOGPROBS; // id, logprob bits, top ids, top logprob bits

/// Threads per block of `sample_rows` (`SAMPLE_THREADS` in sample.cu; the kernel is compiled for exactly this).
const SAMPLE_THREADS: u32 = 512;

/// Words per adjustment after the rows: id, kind (0 add, 1 repetition penalty), value bits.
const ADJUST_WORDS: usize = 3;

/// An absent id or logprob count in the packed words.
const NONE: u32 = u32::MAX;

/// `v` as a word; values past `u32::MAX` saturate (an index or a top-k that large is past any vocabulary anyway).
fn word(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(NONE)
}

/// Packs the rows and their adjustments into one upload: rows.len() * DRAW_WORDS words, then 3 words per
/// adjustment (id, kind, value bits).
pub fn pack_draws(rows: &[DrawRow], adjust: &[Adjustment]) -> Vec<u32> {
    let mut words = Vec::with_capacity(rows.len() * DRAW_WORDS + ADJUST_WORDS * adjust.len());
    for row in rows {
        let d = &row.draw;
        let mut w = [0u32; DRAW_WORDS];
        w[0] = word(row.logit_row);
        w[1] = word(row.adjust.start);
        w[2] = word(row.adjust.end);
        w[3] = row.top_logprobs.map_or(NONE, |n| word(n.min(MAX_TOP_LOGPROBS)));
        w[4] = d.temperature.to_bits();
        w[5] = word(d.top_k);
        w[6] = d.top_p.to_bits();
        w[7] = d.min_p.to_bits();
        // The host's threshold, rounded as filter_ids rounds it (only used where filter_ids uses it).
        w[8] = d.min_p.ln().to_bits();
        w[9..11].copy_from_slice(&split(d.seed));
        w[11..13].copy_from_slice(&split(d.position));
        words.extend_from_slice(&w);
    }
    for a in adjust {
        let kind = match a.kind {
            AdjustKind::Add => 0,
            AdjustKind::Repeat => 1,
        };
        words.extend_from_slice(&[a.id, kind, a.value.to_bits()]);
    }
    words
}

/// `v` as (low word, high word).
fn split(v: u64) -> [u32; 2] {
    [v as u32, (v >> 32) as u32]
}

/// The rows' results from sample_rows' output words.
///
/// # Panics
/// `words` shorter than `rows.len() * DRAWN_WORDS`.
pub fn unpack_drawn(words: &[u32], rows: &[DrawRow]) -> Vec<Drawn> {
    assert!(words.len() >= rows.len() * DRAWN_WORDS, "unpack_drawn: {} words for {} rows", words.len(), rows.len());
    rows.iter()
        .zip(words.chunks_exact(DRAWN_WORDS))
        .map(|(row, w)| {
            let (ids, values) = w[2..].split_at(MAX_TOP_LOGPROBS);
            let logprobs = row.top_logprobs.map(|n| {
                let top = ids
                    .iter()
                    .zip(values)
                    .take(n.min(MAX_TOP_LOGPROBS))
                    .take_while(|(&id, _)| id != NONE)
                    .map(|(&id, &bits)| (id, f32::from_bits(bits)))
                    .collect();
                (f32::from_bits(w[1]), top)
            });
            Drawn { id: w[0], logprobs }
        })
        .collect()
}

/// Workspace for up to `max_rows` rows of `vocab` logits; made once, so a step allocates nothing.
///
/// One f32 row per drawn row (`vocab · 4` bytes): a copy of the raw logits to adjust (rows with adjustments), then
/// the scaled logits (keyed draws). Greedy rows without adjustments, and logprobs, read the logits in place.
#[derive(Debug)]
pub struct SampleScratch {
    rows: DeviceBuf<f32>,
}

impl SampleScratch {
    /// Workspace for `max_rows` rows of `vocab` logits (or fewer rows of longer ones).
    ///
    /// # Errors
    /// Out of device memory.
    pub fn new(dev: &CudaDevice, max_rows: usize, vocab: usize) -> Result<Self> {
        Ok(SampleScratch { rows: dev.alloc_zeros((max_rows * vocab).max(1))? })
    }
}

/// Draws every row of `packed` from the logits where they are: `out[j]` = [`crate::ops::sample::draw_row`] of
/// row `j` (its token; its raw logprob and top logprobs when the row asks), bit for bit but for the ties of
/// measure zero sample.cu describes. One block per row, rows independent of each other: a row's result does not
/// depend on what else is in the launch. Nothing is synchronised, so a step stays capturable.
///
/// `logits`: `[*, vocab]`; `packed`: pack_draws(rows, adjust) for `num_rows` rows; `out`: `[num_rows * DRAWN_WORDS]`.
/// As in `draw_rows`, a logit row past the logits draws from an empty row (id 0, logprob -inf, no top logprobs)
/// and an adjustment range past the adjustments applies none.
///
/// # Errors
/// Lengths that do not form these shapes (`vocab` 0, `packed` not `num_rows` rows plus whole adjustments, `out`
/// not `num_rows` rows), a `scratch` made for fewer rows of `vocab`; a launch failure.
pub fn sample_rows<'a>(
    dev: &CudaDevice,
    logits: impl DevArg<'a, f32>,
    vocab: usize,
    packed: impl DevArg<'a, u32>,
    num_rows: usize,
    out: impl DevArg<'a, u32>,
    scratch: &SampleScratch,
) -> Result<()> {
    let (logits, packed, out) = (logits.dev(), packed.dev(), out.dev());
    if vocab == 0 || !logits.len().is_multiple_of(vocab) {
        return Err(shape_err(format!("sample_rows: logits {} are not rows of {vocab}", logits.len())));
    }
    let head = num_rows * DRAW_WORDS;
    if packed.len() < head || !(packed.len() - head).is_multiple_of(ADJUST_WORDS) {
        return Err(shape_err(format!(
            "sample_rows: {} packed words are not {num_rows} rows of {DRAW_WORDS} and adjustments of {ADJUST_WORDS}",
            packed.len()
        )));
    }
    if out.len() != num_rows * DRAWN_WORDS {
        return Err(shape_err(format!("sample_rows: out {} for {num_rows} rows of {DRAWN_WORDS}", out.len())));
    }
    if num_rows * vocab > scratch.rows.len() {
        return Err(shape_err(format!(
            "sample_rows: scratch of {} logits, {num_rows} rows of {vocab} need {}",
            scratch.rows.len(),
            num_rows * vocab
        )));
    }
    if num_rows == 0 {
        return Ok(());
    }
    let logit_rows = dim(logits.len() / vocab, "logit rows")?;
    let num_adjust = dim((packed.len() - head) / ADJUST_WORDS, "adjustments")?;
    let (grid, rows, vocab) = (dim(num_rows, "rows")?, dim(num_rows, "rows")?, dim(vocab, "vocab")?);
    let rows_buf = scratch.rows.view();
    let mut launch = dev.launch_builder(&dev.kernels.sample_rows);
    launch
        .arg(logits.arg())
        .arg(&logit_rows)
        .arg(&vocab)
        .arg(packed.arg())
        .arg(&rows)
        .arg(&num_adjust)
        .arg(out.arg())
        .arg(rows_buf.arg());
    // SAFETY: the arguments match the kernel's signature; the shapes were checked above (the kernel reads logit
    // rows below `logit_rows` only, adjustment ranges within `num_adjust` only, and writes scratch row j and
    // out row j of its block j < num_rows).
    unsafe { launch.launch(launch_cfg((grid, 1, 1), SAMPLE_THREADS)) }.map_err(launch_err("sample_rows"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::sample::Draw;

    fn rows() -> Vec<DrawRow> {
        let draw = Draw { temperature: 0.7, top_k: 40, top_p: 0.9, min_p: 0.05, seed: u64::MAX - 3, position: 1 << 40 };
        vec![
            DrawRow { logit_row: 2, draw, adjust: 0..2, top_logprobs: Some(5) },
            DrawRow { logit_row: 0, draw: Draw::greedy(), adjust: 2..2, top_logprobs: None },
            DrawRow { logit_row: 1, draw, adjust: 1..3, top_logprobs: Some(0) },
            DrawRow { logit_row: 3, draw, adjust: 0..0, top_logprobs: Some(99) },
        ]
    }

    #[test]
    fn pack_draws_lays_out_rows_then_adjustments() {
        let adjust = [
            Adjustment { id: 7, kind: AdjustKind::Add, value: -1.5 },
            Adjustment { id: 7, kind: AdjustKind::Repeat, value: 1.3 },
            Adjustment { id: 151_000, kind: AdjustKind::Add, value: 100.0 },
        ];
        let rows = rows();
        let words = pack_draws(&rows, &adjust);
        assert_eq!(words.len(), rows.len() * DRAW_WORDS + 3 * adjust.len());
        let r0 = &words[..DRAW_WORDS];
        assert_eq!(&r0[..4], &[2, 0, 2, 5]);
        assert_eq!(f32::from_bits(r0[4]), 0.7);
        assert_eq!(r0[5], 40);
        assert_eq!((f32::from_bits(r0[6]), f32::from_bits(r0[7])), (0.9, 0.05));
        assert_eq!(f32::from_bits(r0[8]), 0.05f32.ln());
        assert_eq!(u64::from(r0[9]) | (u64::from(r0[10]) << 32), u64::MAX - 3);
        assert_eq!(u64::from(r0[11]) | (u64::from(r0[12]) << 32), 1 << 40);
        assert_eq!(&r0[13..], &[0, 0, 0]);
        assert_eq!(words[DRAW_WORDS + 3], NONE, "no logprobs");
        assert_eq!(words[3 * DRAW_WORDS + 3], MAX_TOP_LOGPROBS as u32, "clamped to the most a row reports");
        let tail = &words[rows.len() * DRAW_WORDS..];
        assert_eq!(&tail[..3], &[7, 0, (-1.5f32).to_bits()]);
        assert_eq!(&tail[3..6], &[7, 1, 1.3f32.to_bits()]);
        assert_eq!(tail[6], 151_000);
        let huge = DrawRow { logit_row: usize::MAX, adjust: 0..usize::MAX, ..rows[1].clone() };
        assert_eq!(&pack_draws(&[huge], &[])[..3], &[NONE, 0, NONE], "indices past u32 saturate");
    }

    #[test]
    fn the_kernel_is_compiled_for_these_layouts() {
        let source = crate::cuda::program_source();
        for define in [
            format!("#define SAMPLE_DRAW_WORDS {DRAW_WORDS}\n"),
            format!("#define SAMPLE_MAX_TOP {MAX_TOP_LOGPROBS}\n"),
            format!("#define SAMPLE_THREADS {SAMPLE_THREADS}\n"),
        ] {
            assert!(source.contains(&define), "sample.cu lacks {define:?}");
        }
        assert!(source.contains(
            &format!("#define SAMPLE_STREAM_TARGET {:#X}ull", crate::ops::sample::STREAM_TARGET).replace("0X", "0x")
        ));
    }

    #[test]
    fn unpack_drawn_round_trips_what_the_kernel_writes() {
        let rows = rows();
        let want = [
            Drawn { id: 11, logprobs: Some((-0.25, vec![(11, -0.25), (3, -2.0), (9, f32::MIN_POSITIVE)])) },
            Drawn { id: 4, logprobs: None },
            Drawn { id: 0, logprobs: Some((f32::NEG_INFINITY, vec![])) },
            Drawn { id: 151_935, logprobs: Some((-1e-7, (0..20).map(|i| (i * 7, -(i as f32))).collect())) },
        ];
        // What the kernel writes: unused top slots hold u32::MAX ids.
        let mut words = vec![0u32; rows.len() * DRAWN_WORDS];
        for (w, d) in words.chunks_exact_mut(DRAWN_WORDS).zip(&want) {
            w[0] = d.id;
            w[2..2 + MAX_TOP_LOGPROBS].fill(NONE);
            if let Some((lp, top)) = &d.logprobs {
                w[1] = lp.to_bits();
                for (i, &(id, v)) in top.iter().enumerate() {
                    w[2 + i] = id;
                    w[2 + MAX_TOP_LOGPROBS + i] = v.to_bits();
                }
            }
        }
        assert_eq!(unpack_drawn(&words, &rows), want);
        // A row that asks for fewer than were written gets its count; one that asks for none gets no logprobs.
        let fewer = DrawRow { top_logprobs: Some(2), ..rows[3].clone() };
        let got = unpack_drawn(&words[3 * DRAWN_WORDS..], &[fewer]);
        assert_eq!(got[0].logprobs.as_ref().map(|(_, top)| top.len()), Some(2));
        let none = DrawRow { top_logprobs: None, ..rows[0].clone() };
        assert_eq!(unpack_drawn(&words, &[none])[0], Drawn { id: 11, logprobs: None });
    }
}
