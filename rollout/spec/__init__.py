"""Speculative decoding, exact: the engine's side (`decoder`: propose, verify, gate), and the proposers: n-gram
lookup (`ngram`), a draft model (`draft_model`), a draft head (`head`, its graphs in `head_graph`), the draws
they share with plain decoding (`draws`) and the gate that turns speculation off when it does not pay
(`gate`)."""
