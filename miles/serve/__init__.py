"""`miles serve`: an OpenAI-compatible HTTP server over the embedded engine.

`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (and `/v1/models/{id}`), `GET /health`;
a query string (`?api-version=...`, as Azure-style clients send) is ignored. One thread owns the engine and
steps it while any request is in flight; HTTP handler threads hand it their prompts and wait, so concurrent
requests share engine steps (continuous batching) and the radix cache. Binds 127.0.0.1 unless told otherwise
(an IPv6 host such as `::1` binds an IPv6 socket); with an API key set, every request needs
`Authorization: Bearer <key>`. Request bodies and keys are never logged.

Beyond OpenAI's fields, a request may set `top_k`, `min_p`, `ignore_eos`, `stop_token_ids` and
`return_token_ids` (the prompt's and each choice's token ids, for token-in/token-out clients). `logprobs`
returns the sampled tokens' logprobs, under the distribution they were sampled from (temperature, top-p...:
the engine's convention, docs/rollout.md), with up to 20 alternatives per token under the same distribution
(completions: `logprobs: N`, 0 for the sampled tokens' only; chat: `logprobs: true, top_logprobs: N`). A
token's text and `bytes` are its own bytes (a byte-level token holding part of a character shows the bytes
it lacks a character for as `\\xNN`); a logprob of -inf (an alternative top-p or top-k dropped) is sent as
-9999.0, as vLLM does, so the JSON stays strict. A `temperature` below 1e-5 is greedy (temperature 0): so
small a divisor overflows the logits to NaN. `stream: true` sends server-sent events (OpenAI's chunks, then
`data: [DONE]`; `stream_options.include_usage` adds the usage), holding back the last characters while a
stop string could still take them back, and a `: keep-alive` comment while nothing can be sent (a tool call
being generated, a long prefill). A client that hangs up stops its generation, streamed (a write fails) or
not (its socket is watched while it waits). Chat completions take `tools` (with `tool_choice` "auto",
"none", "required" or a named function, which start the reply with a call's opening, and
`parallel_tool_calls`), `tool_calls` in assistant messages and `tool` messages, and return the
model's calls as `tool_calls`, streamed or not, where the model's chat template renders tools in Qwen's
`<tool_call>` format (tools.py); with a reasoning parser, a thinking model's `<think>` block comes back
as `reasoning_content` (reasoning.py). Not supported, and refused with a 400 rather than ignored: `echo`, a
non-empty `suffix`, `best_of` > 1, logprobs or token ids with streaming, non-zero `frequency_penalty` /
`presence_penalty`, `logit_bias`, the
legacy `functions` / `function_call`, and a `response_format` other than `{"type": "text"}`. Chat content
may be a string or text parts; a chat template that refuses the conversation (`raise_exception`) is a 400.
Tokenizing runs on the engine's thread (the tokenizer is the engine's); a request waiting past
`request_timeout_s` (inf: no limit) gets a 504 and what it still runs is aborted.

Files: `cli` (the command), `app` (the endpoints), `schemas` (request bodies), `worker` (the engine's
thread), `streaming` (server-sent events), `handlers` (HTTP), `tokens` (detokenizing, logprob tokens),
`chat_reply` / `reasoning` / `tools` (a chat reply's message: thinking, tool calls).
"""
