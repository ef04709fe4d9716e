use super::*;
use crate::request::{Event, EventSink, Request};
use crate::sampler::SamplingParams;

struct NullSink;

impl EventSink for NullSink {
    fn send(&mut self, _: Event) -> bool {
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

fn seq(id: &str, prompt_len: usize) -> Sequence {
    let request = Request {
        id: id.into(),
        prompt: (0..prompt_len as u32).collect(),
        sampling: SamplingParams::greedy(),
        max_tokens: 100,
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: true,
        enable_pld: None,
    };
    Sequence::new(request, Box::new(NullSink))
}

fn scheduler(max_running: usize, max_batch_tokens: usize, pages: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig { max_running, max_batch_tokens, page_size: 4 }, pages)
}

/// Applies a plan as the engine would: advance each item, and append a token where it samples.
fn apply(s: &mut Scheduler, items: &[StepItem]) {
    for item in items {
        let seq = &mut s.running[item.seq];
        seq.advance(item.rows);
        if item.samples {
            seq.push_for_test(7);
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
