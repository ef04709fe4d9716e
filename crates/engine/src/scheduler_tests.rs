use super::*;
use crate::request::{NullSink, Request};

fn seq(id: &str, prompt_len: usize) -> Sequence {
    seq_with(id, (0..prompt_len as u32).collect(), true)
}

fn seq_with(id: &str, prompt: Vec<u32>, cache_prompt: bool) -> Sequence {
    let request = Request { cache_prompt, ..Request::for_test(id, prompt, 100) };
    Sequence::new(request, Box::new(NullSink))
}

/// Limits with the prefix cache off, no captured rows and no state checkpoints.
fn limits(max_running: usize, max_batch_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_running,
        max_batch_tokens,
        page_size: 4,
        prefix_cache_pages: 0,
        capture_width: 0,
        checkpoint_stride: 0,
        prefix_cache_checkpoints: 0,
        prompt_cut_alignment: 1,
    }
}

fn scheduler(max_running: usize, max_batch_tokens: usize, pages: usize) -> Scheduler {
    Scheduler::new(limits(max_running, max_batch_tokens), pages)
}

fn cached_scheduler(pages: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig { prefix_cache_pages: pages, ..limits(8, 64) }, pages)
}

/// Applies a plan as the engine would: advance each item, and append a token where it samples; then offer the
/// computed prompt pages to the prefix cache.
fn apply(s: &mut Scheduler, items: &[StepItem]) {
    for item in items {
        let seq = &mut s.running[item.seq];
        seq.advance(item.rows);
        if item.samples {
            seq.push_for_test(7);
        }
    }
    s.publish_prompt_pages();
}

/// Runs plans until `running[0]` has `generated` tokens.
fn run_until(s: &mut Scheduler, generated: usize) {
    loop {
        let items = s.plan();
        apply(s, &items);
        if s.running[0].generated() >= generated {
            return;
        }
    }
}

fn rows(items: &[StepItem]) -> Vec<(usize, usize, bool)> {
    items.iter().map(|i| (i.seq, i.rows, i.samples)).collect()
}

#[test]
fn a_long_prompt_is_chunked_while_others_decode() {
    let mut s = scheduler(4, 8, 64);
    s.waiting.push_back(seq("short", 3));
    s.waiting.push_back(seq("long", 20));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 3, true), (1, 5, false)], "admits both, the long one gets the rest of the budget");
    apply(&mut s, &items);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 7, false)], "the decode row comes first");
    apply(&mut s, &items);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 7, false)]);
    apply(&mut s, &items);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 1, true)], "the prompt's last row samples");
}

#[test]
fn admission_waits_for_a_slot_and_for_pages() {
    let mut s = scheduler(1, 64, 64);
    s.waiting.push_back(seq("a", 5));
    s.waiting.push_back(seq("b", 5));
    let items = s.plan();
    assert_eq!(items.len(), 1);
    assert_eq!(s.waiting.len(), 1, "one slot only");

    let mut s = scheduler(4, 64, 3);
    s.waiting.push_back(seq("a", 7)); // 8 tokens with the first output: 2 pages
    s.waiting.push_back(seq("b", 7));
    s.plan();
    assert_eq!((s.running.len(), s.waiting.len()), (1, 1), "the second prompt does not fit the last page");
    let done = s.retire(0);
    assert!(done.block_table.is_empty());
    assert_eq!(s.pages.free_count(), 3, "retiring frees the pages");
    s.plan();
    assert_eq!(s.running.len(), 1);
}

#[test]
fn decoding_out_of_pages_preempts_the_newest_sequence_and_recomputes_it_later() {
    let mut s = scheduler(4, 64, 4);
    s.waiting.push_back(seq("old", 8)); // fills 2 pages; its first output needs a 3rd
    s.waiting.push_back(seq("new", 4)); // fills 1 page; its first output needs a 2nd
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 8, true), (1, 4, true)]);
    apply(&mut s, &items);
    assert_eq!(s.pages.free_count(), 1);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true)], "the last free page goes to `old`; `new` gives way");
    assert_eq!(s.preemptions, 1);
    let back = s.waiting.front().expect("the preempted sequence waits at the head of the queue");
    assert_eq!((back.request.id.as_str(), back.computed(), back.len()), ("new", 0, 5), "it keeps its output");
    assert!(back.block_table.is_empty());
    apply(&mut s, &items);
    assert!(s.plan().iter().all(|i| i.seq == 0), "no pages for `new` while `old` holds them all");
    s.retire(0);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 5, true)], "readmitted, it recomputes prompt and output in one chunk");
}

#[test]
fn every_decode_row_fits_even_with_a_small_budget() {
    let mut s = scheduler(3, 1, 64);
    assert_eq!(s.config().max_batch_tokens, 3, "raised to max_running");
    for name in ["a", "b", "c"] {
        s.waiting.push_back(seq(name, 1));
    }
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 1, true), (2, 1, true)]);
}

#[test]
fn a_repeated_prompt_starts_after_its_cached_pages_and_shares_them() {
    let mut s = cached_scheduler(16);
    s.waiting.push_back(seq("first", 10)); // pages [0..4) [4..8) full, [8..10) partial
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 10, true)]);
    apply(&mut s, &items);
    assert_eq!(s.pages.cached_count(), 2, "the two full prompt pages");
    let first_pages = s.running[0].block_table.clone();

    s.waiting.push_back(seq("second", 10));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 2, true)], "8 tokens come from the cache");
    let second = &s.running[1];
    assert_eq!((second.computed(), second.prefix.cached_tokens), (8, 8));
    assert_eq!(second.block_table[..2], first_pages[..2], "shared, not copied");
    assert_ne!(second.block_table[2], first_pages[2], "the partial page is its own");
    assert_eq!((s.pages.refs(first_pages[0]), s.prefix_stats.hits, s.prefix_stats.misses), (2, 1, 1));
    assert_eq!(s.prefix_stats.reused_tokens, 8);
}

#[test]
fn a_prompt_of_whole_pages_leaves_its_last_page_to_compute() {
    let mut s = cached_scheduler(16);
    s.waiting.push_back(seq("first", 8));
    let items = s.plan();
    apply(&mut s, &items);
    assert_eq!(s.pages.cached_count(), 2);
    s.waiting.push_back(seq("second", 8));
    let items = s.plan();
    assert_eq!(rows(&items)[1], (1, 4, true), "one page reused: the last token's row yields the logits");
}

#[test]
fn generated_tokens_are_never_cached() {
    let mut s = cached_scheduler(16);
    s.waiting.push_back(seq("talker", 6));
    run_until(&mut s, 12); // 18 tokens: pages up to position 16 are full, only the first holds only prompt
    assert_eq!(s.running[0].len(), 18);
    assert_eq!(s.pages.cached_count(), 1, "pages holding generated tokens stay private");
    let talker = s.retire(0);
    assert_eq!((s.pages.used_count(), s.pages.idle_cached_count()), (0, 1));

    // The conversation goes on: the next prompt holds the answer, which is recomputed as prompt rows.
    s.waiting.push_back(seq_with("next turn", talker.tokens().iter().copied().chain([5, 5]).collect(), true));
    s.plan();
    assert_eq!(s.running[0].computed(), 4);
}

#[test]
fn opting_out_neither_reads_nor_feeds_the_cache() {
    let mut s = cached_scheduler(16);
    s.waiting.push_back(seq_with("private", (0..10).collect(), false));
    let items = s.plan();
    apply(&mut s, &items);
    assert_eq!(s.pages.cached_count(), 0);
    s.waiting.push_back(seq("public", 10));
    let items = s.plan();
    apply(&mut s, &items);
    s.waiting.push_back(seq_with("private again", (0..10).collect(), false));
    let items = s.plan();
    assert_eq!(rows(&items)[2], (2, 10, true), "computed from scratch though the prefix is cached");
    assert_eq!(s.prefix_stats, PrefixStats { hits: 0, misses: 1, reused_tokens: 0 });
}

#[test]
fn admission_counts_idle_cached_pages_as_free_and_evicts_them_but_never_held_ones() {
    let mut s = cached_scheduler(6);
    s.waiting.push_back(seq_with("a", vec![1; 9], true)); // 2 cached pages, 3 held
    let items = s.plan();
    apply(&mut s, &items);
    s.retire(0);
    assert_eq!((s.pages.idle_cached_count(), s.pages.free_count()), (2, 6));

    // 21 tokens + 1 need 6 pages: the free ones, then both idle cached pages, evicted.
    s.waiting.push_back(seq_with("b", vec![2; 21], true));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 21, true)]);
    assert_eq!((s.pages.evictions(), s.pages.cached_count()), (2, 0));
    apply(&mut s, &items);
    assert_eq!(s.pages.cached_count(), 5, "b's five full prompt pages, all held");

    // c would share b's first two pages but needs more free pages than exist: it waits, and nothing b holds goes.
    s.waiting.push_back(seq_with("c", vec![2; 12], true));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true)]);
    assert_eq!((s.running.len(), s.pages.evictions()), (1, 2));
    apply(&mut s, &items);
    s.retire(0);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 4, true)], "admitted after b, on b's cached pages");
}

/// What a lane that reads the target's hidden states was shown: `(first_position, rows)` per call.
type Observed = std::sync::Arc<std::sync::Mutex<Vec<(usize, Vec<f32>)>>>;

struct ObservingProposer(Observed);

impl crate::spec::Proposer for ObservingProposer {
    fn kind(&self) -> crate::spec::LaneKind {
        crate::spec::LaneKind::Dflash
    }
    fn propose(&mut self, _: &crate::spec::ProposeInput, _: usize) -> crate::spec::Proposal {
        crate::spec::Proposal::default()
    }
    fn observes_target(&self) -> bool {
        true
    }
    fn observe(&mut self, first_position: usize, captured: &[f32]) {
        self.0.lock().expect("lock").push((first_position, captured.to_vec()));
    }
}

fn observing_seq(id: &str, prompt_len: usize) -> (Sequence, Observed) {
    use crate::spec::{CostTable, PolicyMode, SharedCosts, SpecLane};
    let observed = Observed::default();
    let mut s = seq(id, prompt_len);
    let proposer = Box::new(ObservingProposer(observed.clone()));
    let costs = SharedCosts::new(CostTable::new(4));
    s.lane = Some(SpecLane::new(proposer, 3, 0, PolicyMode::Fixed, costs));
    (s, observed)
}

const WIDTH: usize = 2;

/// The captured row of position `p`: `[p, p + 0.5]`.
fn captured_rows(positions: std::ops::Range<usize>) -> Vec<f32> {
    positions.flat_map(|p| [p as f32, p as f32 + 0.5]).collect()
}

fn capturing_scheduler(pages: usize, max_batch_tokens: usize) -> Scheduler {
    Scheduler::new(
        SchedulerConfig { prefix_cache_pages: pages, capture_width: WIDTH, ..limits(4, max_batch_tokens) },
        pages,
    )
}

/// As [`apply`], first handing the scheduler the captured rows of every item's positions below `captured_below`.
fn apply_capturing(s: &mut Scheduler, items: &[StepItem], captured_below: usize) {
    for item in items {
        let start = s.running[item.seq].computed();
        let end = (start + item.rows).min(captured_below.max(start));
        s.keep_capture(item.seq, start, &captured_rows(start..end));
    }
    apply(s, items);
}

#[test]
fn a_lane_observing_the_target_starts_from_cached_pages_and_reads_their_captured_rows() {
    // Chunks of 6 rows: the second page's rows arrive over two steps.
    let mut s = capturing_scheduler(16, 6);
    s.waiting.push_back(seq("first", 10));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 6, false)]);
    apply_capturing(&mut s, &items, usize::MAX);
    assert_eq!(s.pages.cached_count(), 1);
    let items = s.plan();
    apply_capturing(&mut s, &items, usize::MAX);
    assert_eq!(s.pages.cached_count(), 2);
    assert_eq!(s.pages.captured(s.running[0].block_table[1]), Some(&captured_rows(4..8)[..]));

    let (second, observed) = observing_seq("second", 10);
    s.waiting.push_back(second);
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 2, true)], "8 tokens come from the cache");
    assert_eq!(*observed.lock().expect("lock"), [(0, captured_rows(0..8))], "the lane saw positions 0..8 at once");
    assert_eq!(s.prefix_stats.reused_tokens, 8);
}

#[test]
fn observing_lanes_never_read_pages_cached_without_captured_rows() {
    let mut s = capturing_scheduler(16, 64);
    s.waiting.push_back(seq("first", 10));
    let items = s.plan();
    // Rows of the first page only: the second is cached without any.
    apply_capturing(&mut s, &items, 4);
    assert_eq!(s.pages.cached_count(), 2);
    assert!(s.pages.captured(s.running[0].block_table[1]).is_none());

    let (observer, observed) = observing_seq("observer", 10);
    s.waiting.push_back(observer);
    s.waiting.push_back(seq("plain", 10));
    s.plan();
    assert_eq!(s.running[1].computed(), 4, "the observer stops at the page without rows");
    assert_eq!(*observed.lock().expect("lock"), [(0, captured_rows(0..4))]);
    assert_eq!(s.running[2].computed(), 8, "a lane-less sequence reads both pages");
}

#[test]
fn pending_captured_rows_follow_chunks_and_restart_after_a_gap() {
    let mut p = crate::sequence::PendingCapture::default();
    p.push(0, &captured_rows(0..3), WIDTH, 10);
    p.push(3, &captured_rows(3..6), WIDTH, 10);
    assert_eq!(p.take(0, 4, WIDTH).as_deref(), Some(&captured_rows(0..4)[..]));
    assert_eq!(p.take(4, 4, WIDTH), None, "positions 6 and 7 are not held yet");
    p.push(6, &captured_rows(6..12), WIDTH, 10);
    assert_eq!(p.take(4, 4, WIDTH).as_deref(), Some(&captured_rows(4..8)[..]));
    assert_eq!(p.take(8, 4, WIDTH), None, "rows past the prompt (10) are not kept");
    p.push(20, &captured_rows(20..24), WIDTH, 30);
    assert_eq!(p.take(8, 4, WIDTH), None, "a gap drops what came before");
    assert_eq!(p.take(20, 4, WIDTH).as_deref(), Some(&captured_rows(20..24)[..]));
}

/// Stride 8 over pages of 4, prompt cuts aligned to `align`.
fn checkpointing_scheduler(max_running: usize, max_batch_tokens: usize, align: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        prefix_cache_pages: 32,
        checkpoint_stride: 8,
        prefix_cache_checkpoints: 8,
        prompt_cut_alignment: align,
        ..limits(max_running, max_batch_tokens)
    };
    Scheduler::new(cfg, 32)
}

/// As [`apply`], snapshotting a due checkpoint after each item's rows as the engine does (the "state" of
/// position `p` is `[p]`).
fn apply_checkpointing(s: &mut Scheduler, items: &[StepItem]) {
    for item in items {
        let seq = &mut s.running[item.seq];
        seq.advance(item.rows);
        if item.samples {
            seq.push_for_test(7);
        }
        if let Some(p) = s.checkpoint_due(item.seq) {
            s.keep_checkpoint(item.seq, p, vec![p as f32]);
        }
    }
    s.publish_prompt_pages();
}

fn checkpoint_at(s: &Scheduler, page: u32) -> Option<f32> {
    s.pages.checkpoint(page).map(|c| c[0])
}

#[test]
fn checkpoint_positions_follow_the_stride_and_spread_out_past_the_bound() {
    assert_eq!(checkpoint_positions(300, 64, 8), [64, 128, 192, 256]);
    assert_eq!(checkpoint_positions(256, 64, 8), [64, 128, 192, 256], "the prompt's end is a prompt position");
    assert!(checkpoint_positions(63, 64, 8).is_empty());
    // 20 boundaries, at most 8: every third one and the deepest.
    let spread = checkpoint_positions(20 * 64 + 5, 64, 8);
    assert_eq!(spread, [3, 6, 9, 12, 15, 18, 20].map(|j| j * 64));
    assert_eq!(checkpoint_positions(20 * 64, 64, 1), [20 * 64], "one: the deepest");
    assert!(checkpoint_positions(300, 0, 8).is_empty() && checkpoint_positions(300, 64, 0).is_empty());
    for n in 1..200 {
        let positions = checkpoint_positions(n * 16, 16, MAX_CHECKPOINTS_PER_SEQUENCE);
        assert!(positions.len() <= MAX_CHECKPOINTS_PER_SEQUENCE, "{n}: {positions:?}");
        assert_eq!(positions.last(), Some(&(n * 16)), "{n}: the deepest is kept");
        assert!(positions.windows(2).all(|w| w[0] < w[1]));
    }
}

#[test]
fn prefill_stops_at_checkpoints_and_a_hit_resumes_from_the_deepest_one_at_or_below_it() {
    let mut s = checkpointing_scheduler(8, 64, 4);
    s.waiting.push_back(seq_with("first", (0..21).collect(), true));
    let mut chunks = Vec::new();
    while s.running.first().is_none_or(|seq| seq.generated() == 0) {
        let items = s.plan();
        chunks.extend(rows(&items));
        apply_checkpointing(&mut s, &items);
    }
    assert_eq!(chunks, [(0, 8, false), (0, 8, false), (0, 5, true)], "chunks end at the checkpoints 8 and 16");
    let table = s.running[0].block_table.clone();
    assert_eq!(s.pages.cached_count(), 5);
    let kept: Vec<Option<f32>> = table[..5].iter().map(|&p| checkpoint_at(&s, p)).collect();
    assert_eq!(kept, [None, Some(8.0), None, Some(16.0), None], "on the pages ending at 8 and 16");
    assert_eq!(s.pages.prefix_cache().checkpoint_count(), 2);

    let sharing = |n: usize| seq_with("sharer", (0..n as u32).chain([99, 98, 97, 96, 95]).collect(), true);
    // 18 shared tokens match 4 pages: resume at 16. 13 match 3: back to 8. 6 match 1, below any checkpoint.
    for n in [18, 13, 6] {
        s.waiting.push_back(sharing(n));
    }
    s.plan();
    let resumed: Vec<(usize, Option<f32>)> =
        s.running[1..].iter().map(|q| (q.computed(), q.prefix.restore.as_ref().map(|c| c[0]))).collect();
    assert_eq!(resumed, [(16, Some(16.0)), (8, Some(8.0)), (0, None)]);
    assert_eq!(s.running[1].block_table[..4], table[..4], "the pages up to the checkpoint are shared");
    assert_eq!(s.running[2].block_table[..2], table[..2]);
    assert_eq!(s.prefix_stats, PrefixStats { hits: 2, misses: 2, reused_tokens: 24 });
}

#[test]
fn prompt_chunks_stop_on_the_alignment_or_cache_nothing_past_an_unaligned_cut() {
    // Budgets of 6 rows: cuts at 4, 8 (a checkpoint), 12, 16 (a checkpoint), then the prompt's end.
    let mut s = checkpointing_scheduler(2, 6, 4);
    s.waiting.push_back(seq_with("aligned", (0..21).collect(), true));
    let mut chunks = Vec::new();
    while s.running.first().is_none_or(|seq| seq.generated() == 0) {
        let items = s.plan();
        chunks.extend(rows(&items));
        apply_checkpointing(&mut s, &items);
    }
    assert_eq!(chunks, [(0, 4, false), (0, 4, false), (0, 4, false), (0, 4, false), (0, 5, true)]);
    assert_eq!((s.pages.cached_count(), s.pages.prefix_cache().checkpoint_count()), (5, 2));

    // Steps of 5 rows: after a 2-token prompt, the 3 rows left cannot reach the cut at 4, so the long prompt
    // waits; beside one decode row, 4 rows can.
    let mut s = checkpointing_scheduler(2, 5, 4);
    s.waiting.push_back(seq_with("short", vec![1, 2], true));
    s.waiting.push_back(seq_with("waiter", (0..21).collect(), true));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 2, true)], "the waiter is admitted but runs nothing");
    apply_checkpointing(&mut s, &items);
    assert_eq!(rows(&s.plan()), [(0, 1, true), (1, 4, false)]);

    // Steps of 3 rows never reach an aligned cut from position 0: the chunk runs anyway (beside a decode row too),
    // and nothing of that prompt is cached.
    let mut s = checkpointing_scheduler(2, 3, 4);
    s.waiting.push_back(seq_with("short", vec![1], true));
    s.waiting.push_back(seq_with("cramped", (0..21).collect(), true));
    let items = s.plan();
    assert_eq!(rows(&items), [(0, 1, true), (1, 2, false)]);
    assert_eq!(s.running[1].prefix.inexact_from, Some(0));
    apply_checkpointing(&mut s, &items);
    s.retire(0);
    run_until(&mut s, 1);
    assert_eq!((s.pages.cached_count(), s.pages.prefix_cache().checkpoint_count()), (0, 0));
    assert_eq!(s.checkpoint_due(0), None);
}

#[test]
fn a_preempted_sequence_drops_its_pending_restore_and_snapshots() {
    let mut s = checkpointing_scheduler(8, 64, 4);
    s.waiting.push_back(seq_with("first", (0..17).collect(), true));
    let items = s.plan();
    apply_checkpointing(&mut s, &items);
    s.waiting.push_back(seq_with("second", (0..17).collect(), true));
    s.plan();
    assert!(s.running[1].prefix.restore.is_some());
    s.running[1].prefix.snapshots.push((20, vec![1.0].into()));
    s.running[1].reset_computed();
    let q = &s.running[1];
    assert!(q.prefix.restore.is_none() && q.prefix.snapshots.is_empty() && q.computed() == 0);
    assert_eq!(q.prefix.checkpoints, [8, 16], "planned from the prompt alone: kept");
}

/// Drafts never make a step wider than the row budget: each decoding sequence keeps its decode row, and drafts
/// take what is left in order.
#[test]
fn drafts_are_cut_to_the_step_budget_and_every_decode_row_stays() {
    let mut s = scheduler(4, 6, 64);
    for id in ["a", "b", "c"] {
        s.waiting.push_back(seq(id, 2));
    }
    let items = s.plan();
    apply(&mut s, &items);
    assert_eq!(s.running.len(), 3);
    assert!(s.running.iter().all(|q| q.is_decoding()), "all three prompts fit the first step");
    for q in &mut s.running {
        q.drafts = vec![1, 2, 3];
    }
    let items = s.plan();
    let rows: Vec<usize> = items.iter().map(|it| it.rows).collect();
    assert_eq!(rows, vec![4, 1, 1], "6 rows: a's decode row and 3 drafts, then one row each for b and c");
    assert_eq!(items.iter().map(|it| it.drafts).collect::<Vec<_>>(), vec![3, 0, 0]);
    assert!(s.running[1].drafts.is_empty() && s.running[2].drafts.is_empty());
    let mut tight = scheduler(4, 4, 64);
    for id in ["a", "b", "c"] {
        tight.waiting.push_back(seq(id, 1));
    }
    let items = tight.plan();
    apply(&mut tight, &items);
    assert_eq!(tight.running.len(), 3);
    for q in &mut tight.running {
        q.drafts = vec![1, 2, 3];
    }
    let rows: Vec<usize> = tight.plan().iter().map(|it| it.rows).collect();
    assert_eq!(rows, vec![2, 1, 1]);
}
