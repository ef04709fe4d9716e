//! The drafters' CPU forward: the per-sequence context of committed positions ([`DrafterContext`]), the block
//! pass (`forward`), DFlash2's convolution (`conv`) and candidate selector (`selector`), and drafts with their
//! distributions (`draft`). A GPU forward would sit beside it, as the target families' do.

pub(super) mod context;
pub(super) mod conv;
pub(super) mod draft;
pub(super) mod forward;
pub(super) mod selector;
