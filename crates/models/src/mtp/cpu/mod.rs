//! The MTP heads' CPU forward: a sequence's history of committed entries ([`context::MtpContext`]) and one chained
//! draft step (`forward`). A GPU forward would sit beside it, as the target families' do.

pub(super) mod context;
mod forward;
