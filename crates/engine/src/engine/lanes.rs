//! Arming a request's lane: which proposer drafts for it (the MTP head, the block drafter, prompt lookup, or a
//! benchmark's oracle) and with what width policy.

use super::Engine;
use crate::request::Request;
use crate::spec::{
    prompt_gate_passes, DflashProposer, MtpProposer, NgramProposer, OracleDraft, OracleProposer, Proposer, SpecLane,
};

impl Engine {
    /// The request's lane: the MTP head, else the block drafter, when the server has one and the request does not
    /// opt out of drafters, with prompt lookup drafting the rounds it leaves plain or lookup's drafts win; else prompt
    /// lookup alone.
    pub(super) fn arm_lane(&self, req: &Request) -> Option<SpecLane> {
        if let Some(draft) = &req.oracle {
            let max = draft.max_draft;
            let proposer = match self.paying_drafter(req, draft) {
                Some(drafter) => OracleProposer::paying(draft.clone(), req.prompt.len(), drafter),
                None => OracleProposer::new(draft.clone(), req.prompt.len()),
            };
            return Some(SpecLane::new(Box::new(proposer), max, 0, self.policy_for(req), self.round_costs.clone()));
        }
        let pld = self.pld_lane(req);
        match self.arm_mtp(req).or_else(|| self.arm_drafter(req)) {
            Some(lane) => Some(match pld {
                Some(pld) => lane.with_fallback(pld),
                None => lane,
            }),
            None => pld,
        }
    }

    /// The request's prompt lookup lane, as its `enable_pld` or the server's setting (behind the prompt gate) say.
    fn pld_lane(&self, req: &Request) -> Option<SpecLane> {
        let cfg = match (req.enable_pld, self.spec.pld) {
            (Some(false), _) | (None, None) => return None,
            (Some(true), cfg) => cfg.unwrap_or_default(),
            (None, Some(cfg)) if prompt_gate_passes(&req.prompt) => cfg,
            (None, Some(_)) => {
                tracing::debug!("{}: the prompt repeats too little for prompt lookup; pld off", req.id);
                return None;
            }
        };
        let proposer = Box::new(NgramProposer::new(cfg));
        Some(SpecLane::new(proposer, cfg.max_draft, 0, self.policy_for(req), self.round_costs.clone()))
    }

    fn arm_mtp(&self, req: &Request) -> Option<SpecLane> {
        let mtp = self.mtp.as_ref().filter(|_| req.enable_drafter != Some(false))?;
        let heads = self.target.host_heads()?;
        let taps = self.target.capture_layers();
        let tap = taps.iter().position(|&l| l + 1 == self.target.config().num_layers)?;
        match MtpProposer::new(mtp, heads, tap, taps.len()) {
            Ok(proposer) => {
                let (policy, costs) = (self.policy_for(req), self.round_costs.clone());
                Some(SpecLane::new(Box::new(proposer), mtp.depth.max(), 0, policy, costs))
            }
            Err(e) => {
                tracing::warn!("{}: no MTP history ({e}); drafting off for this request", req.id);
                None
            }
        }
    }

    fn arm_drafter(&self, req: &Request) -> Option<SpecLane> {
        let drafter = self.drafter.as_ref().filter(|_| req.enable_drafter != Some(false))?;
        let host = self.target.host_heads()?;
        match DflashProposer::new(drafter, host) {
            Ok(proposer) => {
                let block_size = drafter.block_size;
                let (policy, costs) = (self.policy_for(req), self.round_costs.clone());
                Some(SpecLane::new(Box::new(proposer), block_size - 1, block_size, policy, costs))
            }
            Err(e) => {
                tracing::warn!("{}: no drafter context ({e}); drafting off for this request", req.id);
                None
            }
        }
    }

    /// The block drafter an oracle lane with `drafter_pays` runs for its cost, when the engine has one.
    fn paying_drafter(&self, req: &Request, draft: &OracleDraft) -> Option<Box<dyn Proposer>> {
        let drafter = self.drafter.as_ref().filter(|_| draft.drafter_pays)?;
        match DflashProposer::new(drafter, self.target.host_heads()?) {
            Ok(proposer) => Some(Box::new(proposer)),
            Err(e) => {
                tracing::warn!("{}: no drafter context for the oracle to pay ({e})", req.id);
                None
            }
        }
    }

    /// The request's width policy: its own `spec_policy`, else the server's.
    fn policy_for(&self, req: &Request) -> crate::spec::PolicyMode {
        req.spec_policy.unwrap_or(self.spec.policy)
    }
}
