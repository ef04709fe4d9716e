//! Token masks of some logit rows (grammar-constrained greedy rows), handed from the thread that computes them to
//! the target while its forward runs: a device target launches the forward, then waits for the masks and applies
//! them where the logits are, so the host's mask work overlaps the device's.

use std::sync::{Condvar, Mutex};

/// One logit row's allowed tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowMask {
    /// Index into the batch's `logit_rows` (the `k`-th logit row).
    pub logit_row: usize,
    /// Bit `id % 32` of word `id / 32` set for each allowed token id.
    pub allowed: Vec<u32>,
}

/// The masks of one step, published once by their producer and taken once by the target.
#[derive(Debug, Default)]
pub struct RowMasks {
    slot: Mutex<Option<Vec<RowMask>>>,
    ready: Condvar,
}

impl RowMasks {
    /// Hands over the masks; wakes the target if it waits.
    pub fn publish(&self, masks: Vec<RowMask>) {
        let mut slot = self.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = Some(masks);
        self.ready.notify_all();
    }

    /// Takes the masks, waiting until they are published. The producer publishes even when it fails (an empty
    /// list), so this always returns.
    pub fn wait(&self) -> Vec<RowMask> {
        let mut slot = self.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(masks) = slot.take() {
                return masks;
            }
            slot = self.ready.wait(slot).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_published_on_another_thread_reach_the_waiter() {
        let masks = RowMasks::default();
        let want = vec![RowMask { logit_row: 2, allowed: vec![0b101] }];
        let got = std::thread::scope(|s| {
            let waiter = s.spawn(|| masks.wait());
            std::thread::sleep(std::time::Duration::from_millis(20));
            masks.publish(want.clone());
            waiter.join().expect("waiter")
        });
        assert_eq!(got, want);
    }
}
