//! The drafters' CPU forward: the block pass (`forward`), DFlash2's convolution (`conv`) and candidate selector
//! (`selector`), and drafts with their distributions (`draft`). The CUDA forward sits beside it (`../cuda`).

pub(super) mod conv;
pub(super) mod draft;
pub(super) mod forward;
pub(super) mod selector;
