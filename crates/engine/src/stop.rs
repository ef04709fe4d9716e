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

    #[test]
    fn no_stop_strings_emit_everything_at_once() {
        let mut s = scanner(&["", ""]);
        assert_eq!(s.feed("abc"), Scan::Emit("abc".into()));
        assert_eq!(s.flush(), "");
    }
}
