"""Online training of the speculative-decoding drafts (`rollout.spec_draft_train`): a draft model or head."""
