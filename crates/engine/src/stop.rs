//! Stop strings over streamed text: cut before the first match, even when it spans tokens, and never emit text
//! that might turn out to be the start of a stop string.

/// What one piece of text produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scan {
    /// Text safe to emit now (possibly empty while a partial match is held back).
    Emit(String),
    /// A stop string matched: emit this text (everything before the match) and stop.
    Stopped(String),
}

/// Watches a sequence's output text for its stop strings.
///
/// Text that could still grow into a stop string is held back: a suffix of the output that is a proper prefix of
/// some stop string. Everything already emitted therefore ends outside any partial match, so a match can only start
/// in the held text, and searching it alone is exact.
#[derive(Clone, Debug, Default)]
pub struct StopScanner {
    stops: Vec<String>,
    held: String,
}

impl StopScanner {
    /// Empty stop strings are ignored (they would match before any text).
    pub fn new(stops: &[String]) -> Self {
        StopScanner { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new() }
    }

    /// Whether there are stop strings to watch for (without them, text never ends a sequence).
    pub fn watches(&self) -> bool {
        !self.stops.is_empty()
    }

    /// Adds newly decoded text.
    pub fn feed(&mut self, text: &str) -> Scan {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return Scan::Emit(std::mem::take(&mut self.held));
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.held.truncate(at);
            return Scan::Stopped(std::mem::take(&mut self.held));
        }
        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        Scan::Emit(std::mem::replace(&mut self.held, rest))
    }

    /// Releases the held text when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Where the longest suffix of the held text that begins some stop string starts (`held.len()` if none).
    fn partial_match_start(&self) -> usize {
        let held = self.held.as_str();
        held.char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.len() > held.len() - i && s.starts_with(&held[i..])))
            .unwrap_or(held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanner(stops: &[&str]) -> StopScanner {
        StopScanner::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Feeds pieces; returns the emitted text and whether a stop string matched.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = scanner(stops);
        let mut out = String::new();
        for p in pieces {
            match s.feed(p) {
                Scan::Emit(t) => out.push_str(&t),
                Scan::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_spanning_pieces_is_cut_and_not_emitted() {
        assert_eq!(run(&["END"], &["hello E", "N", "D and more"]), ("hello ".into(), true));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn partial_matches_are_held_then_released() {
        let mut s = scanner(&["STOP"]);
        assert_eq!(s.feed("abc ST"), Scan::Emit("abc ".into()));
        assert_eq!(s.feed("O"), Scan::Emit(String::new()));
        assert_eq!(s.feed("RM"), Scan::Emit("STORM".into()));
        assert_eq!(run(&["STOP"], &["go ST", "O"]), ("go STO".into(), false), "flushed at the end");
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["world", "lo w"], &["hello world"]), ("hel".into(), true));
        assert_eq!(run(&["b", "abc"], &["xa", "bc"]), ("x".into(), true), "`abc` starts before `b`");
    }

    #[test]
    fn multibyte_text_is_held_on_char_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run(&["日本語"], &["これは日本", "です"]), ("これは日本です".into(), false));
    }

    /// A fixed-seed splitmix64 stream: `below(n)` in `0..n`.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((z ^ (z >> 31)) % n as u64) as usize
        }

        /// `len` characters of a small alphabet with multi-byte characters in it.
        fn word(&mut self, len: usize) -> String {
            const ALPHABET: [&str; 5] = ["a", "b", "\n", "é", "日"];
            (0..len).map(|_| ALPHABET[self.below(ALPHABET.len())]).collect()
        }
    }

    /// Random texts cut into random pieces, against random stop strings: the output is always the text before the
    /// first match anywhere in the whole text (or all of it), and what is emitted along the way is always a prefix
    /// of that.
    #[test]
    fn any_text_cut_any_way_stops_where_a_search_of_the_whole_text_does() {
        let mut rng = Rng(7);
        for case in 0..3000 {
            let len = rng.below(24);
            let text = rng.word(len);
            let stops: Vec<String> = (0..rng.below(3))
                .map(|_| {
                    let len = 1 + rng.below(3);
                    rng.word(len)
                })
                .collect();
            let chars: Vec<char> = text.chars().collect();
            let mut pieces = Vec::new();
            let mut i = 0;
            while i < chars.len() {
                let take = 1 + rng.below(4).min(chars.len() - i - 1);
                pieces.push(chars[i..i + take].iter().collect::<String>());
                i += take;
            }
            let first = stops.iter().filter_map(|s| text.find(s.as_str())).min();
            let want = (first.map_or(text.as_str(), |at| &text[..at]).to_string(), first.is_some());
            let mut scanner = StopScanner::new(&stops);
            let (mut out, mut stopped) = (String::new(), false);
            for piece in &pieces {
                match scanner.feed(piece) {
                    Scan::Emit(t) => out.push_str(&t),
                    Scan::Stopped(t) => {
                        out.push_str(&t);
                        stopped = true;
                        break;
                    }
                }
                assert!(
                    want.0.starts_with(&out),
                    "case {case}: emitted {out:?} beyond {want:?} ({stops:?}, {pieces:?})"
                );
            }
            if !stopped {
                out.push_str(&scanner.flush());
            }
            assert_eq!((out, stopped), want, "case {case}: stops {stops:?}, pieces {pieces:?}");
        }
    }

    #[test]
    fn no_stop_strings_emit_everything_at_once() {
        let mut s = scanner(&["", ""]);
        assert_eq!(s.feed("abc"), Scan::Emit("abc".into()));
        assert_eq!(s.flush(), "");
    }
}
