"""Multi-turn rollouts (tools, environments, agents): `rollout.generate_fn`.

A generate plugin is `async def generate(client, sample, params) -> Sample | list[Sample]`, called once per
sample (`n` times per prompt, `sample.index` 0..n-1). `client.generate(ids, params)` runs one model turn on
the embedded engine, token ids in, a `Sample` of the new tokens out (with their logprobs); between turns the
plugin appends what the environment says (a tool's output, a user message) as tokens. `Trajectory` assembles
the result: the model's tokens train (`loss_mask` 1, the engine's logprobs), the environment's do not
(`loss_mask` 0). A turn's prompt repeats the conversation so far, which the radix cache already holds, so
only the new tokens are computed.

Every plugin call of a batch runs as a coroutine on one event loop, kept for the `MultiTurnRollout`'s life
(so a plugin's module-level asyncio objects, clients and semaphores, keep working from batch to batch), and
one driver steps the engine while any of them waits for a turn: turns of different samples share engine
steps (continuous batching). Called from a running event loop (a notebook), a batch runs on a thread of its
own. A plugin that blocks (a slow tool called without `await`) holds up every sample's turns; run such a
tool in `asyncio.to_thread`. A plugin that raises, returns something malformed or runs past
`rollout.generate_timeout_s` costs its sample (status aborted, `metadata["error"]`, counted in
`rollout/generate_errors`), never the batch. A turn the engine refuses as misconfigured (stop strings
without a tokenizer, released memory) fails the batch instead, as single-turn generation would.

Seeds: the engine mixes each turn's context (its prompt ids) into its seed, so turns from different contexts
draw independently with `params.seed` as given, and a sample's first turn draws as single-turn generation
would. The k-th turn of a sample from a context it already generated from (branches) takes
`derive_seed(params.seed, k)`. Either way a rollout is reproducible, also when its turns run concurrently
(`asyncio.gather`) and finish in any order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from miles.rollout.sampling.params import SamplingParams
from miles.rollout.sampling.sampler import derive_seed, prompt_key
from miles.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

GenerateFn = Callable[["EngineClient", Sample, SamplingParams], Awaitable["Sample | list[Sample]"]]


@dataclass
class Trajectory:
    """A multi-turn sample being built: the prompt, then model turns (trained on) and environment tokens."""

    prompt: Sample
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    status: SampleStatus = SampleStatus.COMPLETED
    """The last model turn's (TRUNCATED when it hit its length cap)."""
    turns: int = 0
    weight_version: int = 0
    error: str | None = None
    """Why the last model turn was aborted (its `metadata["error"]`, e.g. a prompt past the context)."""

    @property
    def ids(self) -> list[int]:
        """The conversation so far, as the next turn's prompt."""
        return [*self.prompt.prompt_ids, *self.response_ids]

    def add_turn(self, turn: Sample) -> None:
        """A model turn from `client.generate`: its tokens train, with the engine's logprobs."""
        self.response_ids += turn.response_ids
        self.rollout_logprobs += turn.rollout_logprobs
        self.loss_mask += [1] * len(turn.response_ids)
        self.status, self.weight_version = turn.status, turn.weight_version
        self.error = turn.metadata.get("error") if turn.status == SampleStatus.ABORTED else None
        self.turns += 1

    def add_tokens(self, ids: list[int]) -> None:
        """Environment tokens (a tool's output, a user turn): in the context, not trained on."""
        self.response_ids += [int(t) for t in ids]
        self.rollout_logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def to_sample(self, tokenizer: Any = None) -> Sample:
        text = tokenizer.decode(self.response_ids, skip_special_tokens=True) if tokenizer is not None else ""
        return replace(
            self.prompt,
            response_ids=list(self.response_ids),
            response_text=text,
            rollout_logprobs=list(self.rollout_logprobs),
            loss_mask=list(self.loss_mask),
            status=self.status,
            weight_version=self.weight_version,
            metadata={
                **self.prompt.metadata,
                "turns": self.turns,
                **({"error": self.error} if self.error is not None else {}),
            },
        )


class EngineRefused(Exception):
    """`Engine.add_request` refused a turn: a configuration error, which fails the batch (not one sample)."""


class EngineClient:
    """One sample's access to the embedded engine from its generate plugin."""

    def __init__(self, rollout: MultiTurnRollout, sample: Sample) -> None:
        self._rollout, self._sample = rollout, sample
        self._branches: dict[int, int] = {}
        """Turns so far from each context (by its hash): the k-th from one context draws with seed k."""
        self.rids: list[int] = []
        """Its requests so far (the driver aborts those still running when the plugin fails)."""

    @property
    def tokenizer(self) -> Any:
        return self._rollout.engine.tokenizer

    @property
    def max_context(self) -> int:
        """Tokens a turn's prompt and response may hold together: the model's context, or fewer where the
        engine's KV pool is smaller (a request's newest token needs no slot, so it reaches the pool's size + 1)."""
        engine = self._rollout.engine
        return getattr(engine, "max_seq_len", engine.max_context)  # (stand-in engines may have no pool)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids (client.generate takes ids)")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer to decode with")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        """One model turn after `prompt_ids`: a Sample whose response is the new tokens (status aborted with
        `metadata["error"]` if the engine refused the prompt, e.g. longer than `max_context`; truncated where
        the turn reaches `max_context`)."""
        ids = [int(t) for t in prompt_ids]  # a malformed list fails here, in the plugin: its sample only
        key = prompt_key(ids)
        branch = self._branches.get(key, 0)
        self._branches[key] = branch + 1
        seed = params.seed if params.seed is None or branch == 0 else derive_seed(params.seed, branch)
        # (A turn that outgrows the KV pool ends TRUNCATED where the pool is full, as at the end of the
        # context: the engine's own `max_seq_len`.)
        return await self._rollout._submit(self, ids, params.with_(n=1, seed=seed), self._sample)


class MultiTurnRollout:
    """`generate(prompts, params)` through a generate plugin, the drop-in for `Engine.generate`."""

    def __init__(self, engine: Any, generate_fn: GenerateFn, timeout_s: float = 0.0) -> None:
        if not inspect.iscoroutinefunction(generate_fn) and not inspect.iscoroutinefunction(
            getattr(generate_fn, "__call__", None)  # noqa: B004 - an object with an async __call__
        ):
            raise ValueError(
                "rollout.generate_fn must be an async function: async def generate(client, sample, params)"
            )
        self.engine, self.fn, self.timeout_s = engine, generate_fn, timeout_s
        self.errors = 0
        """Samples lost to a failing or timed-out plugin since the last `metrics()`."""
        self._pending: dict[int, asyncio.Future[Sample]] = {}
        self._discard: set[int] = set()
        """Requests of a failed batch, aborted: their results are dropped as they come out."""
        self._loop = asyncio.new_event_loop()
        self.on_step: Callable[[], None] | None = None
        """Called after every engine step it drives (a health check's heartbeat)."""

    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """`len(prompts) * params.n` samples, prompt-major (more where a plugin returns several per call)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(self._run(prompts, params))
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="miles-multiturn") as thread:
            return thread.submit(self._loop.run_until_complete, self._run(prompts, params)).result()

    def close(self) -> None:
        self._loop.close()

    def metrics(self) -> dict[str, float]:
        errors, self.errors = self.errors, 0
        return {"rollout/generate_errors": float(errors)}

    async def _run(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        device = getattr(self.engine, "device", None)
        if device is not None and device.type == "cuda":  # (a thread of its own starts on cuda:0)
            torch.cuda.set_device(device)
        one = params.with_(n=1)
        calls = [
            asyncio.ensure_future(self._call(replace(prompt, index=index), one))
            for prompt in prompts
            for index in range(params.n)
        ]
        try:
            await self._drive(calls)
        except BaseException:  # the engine failed: leave nothing of this batch behind for the next one
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            for rid in self._pending:
                self.engine.abort(rid)
            self._discard.update(self._pending)
            self._pending.clear()
            raise
        # Every call's exception is retrieved (else asyncio reports them at exit).
        failures = [err for err in (call.exception() for call in calls) if err is not None]
        if failures:  # a refused turn (EngineRefused): the batch's configuration is wrong
            raise failures[0]
        samples = [sample for call in calls for sample in call.result()]
        # A group is its prompt's (advantages are per group); a call may return several samples, so the
        # indices are counted within each group again.
        counts: dict[int, int] = {}
        for i, sample in enumerate(samples):
            index = counts.get(sample.group_id, 0)
            counts[sample.group_id] = index + 1
            if sample.index != index:
                samples[i] = replace(sample, index=index)
        return samples

    async def _submit(
        self, client: EngineClient, prompt_ids: list[int], params: SamplingParams, sample: Sample
    ) -> Sample:
        try:
            rid = self.engine.add_request(
                prompt_ids, params, group_id=sample.group_id, index=sample.index, source=sample
            )
        except Exception as err:
            raise EngineRefused(f"{type(err).__name__}: {err}") from err
        client.rids.append(rid)
        future: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        return await future

    async def _drive(self, calls: list[asyncio.Future[list[Sample]]]) -> None:
        """Step the engine while a turn waits; let the plugins run between steps. Goes on until every request
        has come back, those of failed plugins included, so the engine is left empty."""
        idle_steps = 0
        while self._pending or not all(call.done() for call in calls):
            if not self._pending:
                await asyncio.sleep(0.001)  # the plugins are between turns (a tool, I/O)
                continue
            self.engine.step()
            if self.on_step is not None:
                self.on_step()
            self._discard = {rid for rid in self._discard if self.engine.take_result(rid) is None}
            resolved = False
            for rid in list(self._pending):
                result = self.engine.take_result(rid)
                if result is not None:
                    future = self._pending.pop(rid)
                    if not future.done():  # cancelled with its plugin (a timeout)
                        future.set_result(result)
                    resolved = True
            idle_steps = 0 if resolved or self.engine.has_unfinished else idle_steps + 1
            if idle_steps > 100:
                raise RuntimeError(
                    "rollout engine made no progress on a generate plugin's turn; please report it"
                )
            await asyncio.sleep(0)

    async def _call(self, sample: Sample, params: SamplingParams) -> list[Sample]:
        client = EngineClient(self, sample)
        try:
            call = self.fn(client, sample, params)
            out = await (asyncio.wait_for(call, self.timeout_s) if self.timeout_s > 0 else call)
            return self._checked(out, sample)
        except EngineRefused:
            self._abort(client)
            raise
        except asyncio.CancelledError as err:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the driver's own cancellation: let it through
                raise
            return self._failed(client, sample, err)  # the plugin cancelled something of its own
        except Exception as err:  # the plugin's failure costs its sample, never the batch
            return self._failed(client, sample, err)

    def _abort(self, client: EngineClient) -> None:
        for rid in client.rids:
            if rid in self._pending:
                self.engine.abort(rid)

    def _failed(self, client: EngineClient, sample: Sample, err: BaseException) -> list[Sample]:
        self._abort(client)
        self.errors += 1
        reason = "timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
        log.warning("generate plugin failed on group %d sample %d: %s", sample.group_id, sample.index, reason)
        return [
            replace(
                sample,
                response_ids=[],
                response_text="",
                rollout_logprobs=[],
                loss_mask=[],
                status=SampleStatus.ABORTED,
                metadata={**sample.metadata, "error": f"generate plugin: {reason}"},
            )
        ]

    def _checked(self, out: Sample | list[Sample], sample: Sample) -> list[Sample]:
        samples = [out] if isinstance(out, Sample) else list(out) if isinstance(out, list | tuple) else None
        if not samples or not all(isinstance(s, Sample) for s in samples):
            raise TypeError(
                f"a generate plugin returns a Sample or a non-empty list of them, not {type(out).__name__}"
            )
        for s in samples:
            n = len(s.response_ids)
            if not s.prompt_ids or not all(isinstance(t, int) for t in [*s.prompt_ids, *s.response_ids]):
                raise ValueError("a returned sample needs its prompt_ids, and token ids that are ints")
            if len(s.rollout_logprobs) != n or (s.loss_mask and len(s.loss_mask) != n):
                raise ValueError(
                    f"a returned sample has {n} response tokens, {len(s.rollout_logprobs)} logprobs and "
                    f"{len(s.loss_mask)} loss_mask entries; build it with Trajectory, which keeps them aligned"
                )
            if any(m not in (0, 1) for m in s.loss_mask):
                raise ValueError("a returned sample's loss_mask holds 0s and 1s only")
        return [s if s.group_id == sample.group_id else replace(s, group_id=sample.group_id) for s in samples]
