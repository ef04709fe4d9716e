//! How a device target pads a decode or verify step to the CUDA graph it replays, so the engine can price a step
//! by the rows the device really runs. A step's cost follows its padded rows, not its rows: one sequence verifying
//! 4 rows beside 63 one-row sequences runs as 80 rows and costs what a uniform step of 80 sequences does, while
//! 60 one-row sequences and 3 verify rows stay within 64 (PERFORMANCE.md entry 120).

/// The graph buckets of a device target's decode and verify steps (within a cache's capacities).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPadding {
    /// Most rows a graph step holds; a step padded past it runs eagerly, unpadded.
    pub max_rows: usize,
    /// Most sequences a graph step may be padded to.
    pub max_seqs: usize,
    /// Whether steps whose sequences have different row counts replay graphs too (else they run eagerly).
    pub mixed: bool,
}

impl StepPadding {
    /// Sequences, rows per sequence and rows in all of the graph a step of `n` sequences replays, the widest of
    /// which has `widest` rows, `total` in all; `None` where it runs eagerly. Sequences with the same rows pad the
    /// sequences to a bucket ([`graph_seqs`]), each padded one with those rows. A step whose sequences have
    /// different counts (with [`Self::mixed`]) pads its rows in all to a bucket too, and its most rows per sequence
    /// to a power of two; the padded rows go to padded sequences, at most that many each (so a graph's attention
    /// keeps its tiles' shape), and some padded sequences may have none.
    pub fn shape(&self, n: usize, widest: usize, total: usize) -> Option<(usize, usize, usize)> {
        if n == 0 || widest == 0 {
            return None;
        }
        let fits = |&(seqs, _, tokens): &(usize, usize, usize)| seqs <= self.max_seqs && tokens <= self.max_rows;
        // Every sequence has at most `widest` rows, so `n · widest` rows in all means every one has that many.
        if total == n * widest {
            return [graph_seqs(n), n].into_iter().map(|s| (s, widest, s * widest)).find(fits);
        }
        if !self.mixed {
            return None;
        }
        let rows = widest.next_power_of_two();
        let tokens = graph_seqs(total);
        let padded = (graph_seqs(n + (tokens - total).div_ceil(rows)), rows, tokens);
        [padded, (n, rows, total)].into_iter().find(fits)
    }

    /// Rows the device runs for a step of `sequences` sequences, `rows` in all, the widest with `widest`: its
    /// graph's padded rows, or `rows` where it runs eagerly.
    pub fn rows(&self, sequences: usize, rows: usize, widest: usize) -> usize {
        let widest = widest.clamp(1, rows.max(1));
        self.shape(sequences.max(1), widest, rows).map_or(rows, |(_, _, tokens)| tokens)
    }
}

/// Sequences a graph step of `n` sequences is padded to: a power of two up to 16, past it the next multiple of an
/// eighth of `n`'s power of two (20, 24, 28, 32, 40, 48, ...), so a step pads less than a quarter of its sequences
/// where powers of two padded up to half (20 sequences ran as 32: PERFORMANCE.md entry 98).
/// `DFLASH_GRAPH_BUCKETS=pow2` pads to powers of two.
pub fn graph_seqs(n: usize) -> usize {
    if n <= 16 || dflash_runtime::switches::switches().graph_pow2_buckets {
        return n.next_power_of_two();
    }
    let step = n.next_power_of_two() / 8;
    n.div_ceil(step) * step
}

#[cfg(test)]
mod tests {
    use super::*;

    const PADDING: StepPadding = StepPadding { max_rows: 256, max_seqs: 512, mixed: true };

    #[test]
    fn graph_steps_pad_to_fine_buckets() {
        let buckets: Vec<usize> = [1, 3, 5, 9, 16, 17, 20, 24, 33, 63, 64, 65, 100, 128, 129, 200, 256]
            .iter()
            .map(|&n| graph_seqs(n))
            .collect();
        assert_eq!(buckets, [1, 4, 8, 16, 16, 20, 20, 24, 40, 64, 64, 80, 112, 128, 160, 224, 256]);
        for n in 17..=1024 {
            let b = graph_seqs(n);
            assert!(b >= n && 4 * (b - n) < n, "{n} sequences pad to {b}");
        }
    }

    #[test]
    fn a_step_runs_the_rows_of_its_graph() {
        // One row each: the sequences' bucket.
        assert_eq!(PADDING.rows(60, 60, 1), 64);
        assert_eq!(PADDING.rows(64, 64, 1), 64);
        assert_eq!(PADDING.rows(65, 65, 1), 80);
        // A lone sequence verifying: its rows.
        assert_eq!(PADDING.rows(1, 7, 7), 7);
        // One sequence verifying 4 rows: within the bucket beside 60, the next bucket beside 63 or 64.
        assert_eq!(PADDING.rows(60, 63, 4), 64);
        assert_eq!(PADDING.rows(63, 66, 4), 80);
        assert_eq!(PADDING.rows(64, 67, 4), 80);
        // Eight sequences, one verifying 8 rows: 15 rows run as 16; a second such round runs 24.
        assert_eq!(PADDING.rows(8, 15, 8), 16);
        assert_eq!(PADDING.rows(8, 22, 8), 24);
    }

    #[test]
    fn steps_past_the_graphs_run_their_own_rows() {
        let small = StepPadding { max_rows: 64, max_seqs: 128, mixed: true };
        assert_eq!(small.rows(60, 70, 4), 70, "more rows than a graph holds");
        let uniform_only = StepPadding { mixed: false, ..PADDING };
        assert_eq!(uniform_only.rows(64, 67, 4), 67, "a family without mixed graphs runs them eagerly");
        assert_eq!(uniform_only.rows(60, 60, 1), 64);
        // Uniform steps of several rows a sequence pad their sequences.
        assert_eq!(PADDING.shape(3, 4, 12), Some((4, 4, 16)));
        assert_eq!(PADDING.shape(0, 1, 0), None);
    }
}
