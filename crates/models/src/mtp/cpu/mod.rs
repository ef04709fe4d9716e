//! The MTP heads' CPU forward: committed entries appended to a history and chained draft steps past it; the CUDA
//! forward sits beside it (`../cuda`).

mod forward;
