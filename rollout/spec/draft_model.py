"""Draft tokens for speculative decoding from a smaller model (`rollout.speculative=draft`).

The draft model keeps its own paged KV cache (a pool and request table of its own, the engine's attention
backend and CUDA graphs) over the tokens it has been fed for each running request. Proposing for a step:
feed every request the tokens it has not seen yet (its prompt the first time, then the tokens the last
verify step kept), in chunks of at most `max_batch_tokens`, then run k - 1 decode steps on its own drafts.
Positions it computed for drafts the target rejected are simply written again: the cache of a sequence is
valid up to the first token that differs from the request's.

Draft tokens are drawn as draws.py says, coupled to plain decoding's draws.

Drafting is optional per request: a request whose sequence the draft pool cannot hold this step, or that
is past the draft model's context, gets no draft and decodes one token as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from miles.config import RolloutConfig
from miles.models.checkpoint import from_pretrained
from miles.models.model import CausalLM
from miles.rollout.forward_batch import ForwardBatch, concat_ranges, host_to_device
from miles.rollout.kv.manager import KVManager
from miles.rollout.kv.pool import KVPool, RequestTable
from miles.rollout.model_runner import ModelRunner
from miles.rollout.request import Request
from miles.rollout.spec.draws import DraftDraws


def load_draft_model(model: CausalLM, cfg: RolloutConfig, draft: CausalLM | None = None) -> CausalLM:
    """The draft model of `rollout.speculative=draft`: `draft` if given, else `rollout.spec_draft_model`
    loaded in the model's dtype on its device; checked against the model it drafts for."""
    if draft is None:
        if not cfg.spec_draft_model:
            raise ValueError(
                "rollout.speculative=draft needs a draft model: set rollout.spec_draft_model to a checkpoint "
                "folder (a smaller model with the same tokenizer), or use rollout.speculative=ngram"
            )
        from miles.model_io import load_model, resolve_path

        dtype = str(model.dtype).removeprefix("torch.")
        folder = resolve_path(cfg.spec_draft_model)  # a folder needs no tokenizer: the model's is used
        if folder is not None:
            draft = from_pretrained(folder, dtype=dtype, device=model.device)
        else:
            draft = load_model(cfg.spec_draft_model, dtype, str(model.device), seed=cfg.seed + 1).model
    if draft.args.vocab_size > model.args.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.args.vocab_size} tokens) is larger than the model's "
            f"({model.args.vocab_size}): a draft model must share the model's tokenizer"
        )
    if draft.device != model.device or draft.dtype != model.dtype:
        raise ValueError(
            f"the draft model is {draft.dtype} on {draft.device}, the model {model.dtype} on {model.device}: "
            "load it with the model's dtype and device"
        )
    return draft.eval()


@dataclass(eq=False)
class SharedPrompt:
    """A prompt's draft keys and values, held once for the requests that start with it (a group's samples)."""

    tokens: tuple[int, ...]
    slots: torch.Tensor
    """The slots of positions [0, len(tokens)), on the device."""
    users: int = 1
    """Sequences whose rows point at them; the slots are freed with the last."""


@dataclass
class DraftSequence:
    """The draft model's state for one request."""

    row: int
    """Its row of the draft's request table."""
    fed: list[int]
    """Tokens fed so far: positions [0, len(fed)) have draft keys and values."""
    agreed: int = 0
    """Positions [0, agreed) of `fed` are known to equal the request's tokens."""
    slots: int = 0
    """Positions [0, slots) of its row have KV slots."""
    prompt: SharedPrompt | None = None
    """Where positions [0, len(prompt.tokens)) of its row are a shared prompt's slots, not its own."""


_DECODED_CATCH_UP = 4
"""Most new tokens of a request fed to the draft as decode steps (CUDA graphs) rather than one forward."""


@dataclass
class _Work:
    """A request drafted for in this proposal."""

    index: int
    """Its place in `propose`'s arguments."""
    req: Request
    seq: DraftSequence
    start: int
    """The first position fed (what the sequence holds before it agrees with the request)."""
    k: int
    """Drafts it gets."""


class DraftModel:
    def __init__(self, runner: ModelRunner, max_batch_tokens: int, model_vocab_size: int) -> None:
        """`model_vocab_size`: the vocabulary of the model drafted for (at least the draft's); token ids the
        draft does not have are fed to it as its last id (which only makes its drafts worse)."""
        self.runner = runner
        self.model: CausalLM = runner.model
        self.pool: KVPool = runner.pool
        self.table: RequestTable = runner.table
        self.kv = KVManager(self.pool, self.table, None)
        self.max_batch_tokens = max_batch_tokens
        self.max_context = min(self.model.args.context_length, self.table.max_context)
        self.device = self.model.device
        self.clamp_ids = self.model.args.vocab_size < model_vocab_size
        self.decoded_catch_up: bool | None = None
        """Whether the few tokens a verify step kept go in as decode steps; None: where the draft's decode
        steps replay CUDA graphs (a multi-token forward runs eagerly, layer by layer)."""
        self.seqs: dict[int, DraftSequence] = {}
        """Request id -> its draft state, for running requests (`retain` drops the others)."""
        self.prompts: dict[tuple[int, ...], SharedPrompt] = {}
        """Prompts held once for every sequence that starts with them."""
        self.reserved: dict[int, SharedPrompt] = {}
        """Request id -> the shared prompt it skipped a proposal for (another request computed it), held for
        it until it attaches (`_new_sequence`) or leaves (`retain`, `forget`): the request that computed the
        prompt may finish in that very step, which must not take the prompt away from the others."""
        self.share_prompts = True
        """Whether requests with the same prompt share its draft KV (off: each computes and holds its own)."""
        self.draws = self.graphed_draws = 0
        """Draft draws made, and those that replayed a sampler graph."""

    @property
    def catch_up_by_decoding(self) -> bool:
        if self.decoded_catch_up is not None:
            return self.decoded_catch_up
        return self.runner.graphs is not None  # None again after a capture ran out of memory

    # state ---------------------------------------------------------------------------------------
    def _unuse(self, shared: SharedPrompt) -> None:
        """One user (a sequence, or a request it is reserved for) fewer; the slots go back with the last."""
        shared.users -= 1
        if not shared.users:
            self.pool.free_slots(shared.slots)
            del self.prompts[shared.tokens]

    def _drop(self, rid: int) -> None:
        seq = self.seqs.pop(rid)
        own = 0
        if seq.prompt is not None:
            own = len(seq.prompt.tokens)
            self._unuse(seq.prompt)
        if seq.slots > own:
            self.pool.free_slots(self.table.table[seq.row, own : seq.slots])
        self.table.free(seq.row)

    def retain(self, keep: set[int]) -> None:
        """Drop the sequences (and reserved prompts) of requests not in `keep` (the running requests' ids)."""
        for rid in [rid for rid in self.seqs if rid not in keep]:
            self._drop(rid)
        for rid in [rid for rid in self.reserved if rid not in keep]:
            self._unuse(self.reserved.pop(rid))

    def forget(self, rid: int) -> None:
        """Drop a finished request's sequence (or the prompt reserved for it)."""
        if rid in self.seqs:
            self._drop(rid)
        if rid in self.reserved:
            self._unuse(self.reserved.pop(rid))

    def release(self) -> None:
        """Free the pool (colocated training): every sequence is dropped first, its slots back in the pool."""
        self.retain(set())
        self.runner.release(keep_graphs=self.pool.keeps_addresses)
        self.pool.release()

    def resume(self) -> None:
        self.pool.allocate()

    def _new_sequence(self, req: Request, starting: dict[tuple[int, ...], list[int]]) -> DraftSequence | None:
        """A sequence for a request the draft has not seen; None where it cannot have one this proposal.

        A request whose prompt the draft holds already starts from it: its row points at the shared slots,
        and it is fed only its output. One whose prompt another new request of this proposal will compute
        waits for the next proposal, when that prompt is shared (so the `n` samples of a group compute and
        hold their prompt once, at the cost of one step without drafts for all but one of them); the prompt
        is reserved for it meanwhile (`_share_prompts`). `starting`: prompt -> the requests waiting for it."""
        if not self.table.num_free:
            return None
        shared, key = None, None
        # A request with no output yet would be fed its last prompt token again, into a shared slot.
        if self.share_prompts and req.output_ids:
            key = tuple(req.prompt_ids)
            shared = self.prompts.get(key)
            if shared is None and key in starting:
                starting[key].append(req.rid)
                return None
        seq = self.seqs[req.rid] = DraftSequence(self.table.alloc(), [])
        reserved = self.reserved.pop(req.rid, None)
        if shared is not None:
            length = len(shared.tokens)
            self.table.table[seq.row, :length] = shared.slots
            seq.fed, seq.agreed, seq.slots, seq.prompt = list(shared.tokens), length, length, shared
            if reserved is not shared:  # else its reservation becomes its use
                shared.users += 1
        elif key is not None:
            starting[key] = []
        if reserved is not None and reserved is not shared:  # (its prompt is this one while it runs)
            self._unuse(reserved)
        return seq

    def _share_prompts(self, work: list[_Work], starting: dict[tuple[int, ...], list[int]]) -> None:
        """After a proposal fed them: the prompts of the new sequences computed this proposal become shared,
        and each is reserved for the requests that waited for it."""
        for w in work:
            seq, length = w.seq, len(w.req.prompt_ids)
            if seq.prompt is not None or len(seq.fed) < length:
                continue
            key = tuple(w.req.prompt_ids)
            if key in starting and key not in self.prompts:
                shared = SharedPrompt(key, self.table.table[seq.row, :length].clone())
                seq.prompt = self.prompts[key] = shared
                for rid in starting[key]:
                    if rid not in self.reserved:
                        self.reserved[rid] = shared
                        shared.users += 1

    def _agreed(self, seq: DraftSequence, req: Request) -> int:
        """Length of the common prefix of what the sequence was fed and the request's tokens, short of the
        request's last token (always fed: its logits give the first draft)."""
        end = min(len(seq.fed), req.seq_len - 1)
        at = min(seq.agreed, end)
        if at < end:
            for fed, token in zip(seq.fed[at:end], req.tokens(at, end)):
                if fed != token:
                    break
                at += 1
        return at

    # proposing -----------------------------------------------------------------------------------
    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow each request's sequence ([] where it cannot draft)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        work: list[_Work] = []
        needs: list[int] = []
        free = self.pool.free_tokens
        starting: dict[tuple[int, ...], list[int]] = {}
        for i, (req, k) in enumerate(zip(reqs, ks)):
            k = min(k, self.max_context - req.seq_len + 1)
            if k <= 0:
                self.forget(req.rid)  # past the draft's context: it never drafts again
                continue
            # A request's output changes only by growing while it runs (it is reset only while retracted,
            # and the engine drops the sequences of requests that left the running set: `retain`).
            seq = self.seqs.get(req.rid)
            new = seq is None
            if new:
                seq = self._new_sequence(req, starting)
                if seq is None:
                    continue
            # Positions it will write: the request's tokens from where it disagrees, then drafts 0 .. k - 2.
            need = max(0, req.seq_len + k - 1 - seq.slots)
            if need > free:
                if new:  # fed nothing: it holds no row until it can be (and computes no prompt for others)
                    self._drop(req.rid)
                    if seq.prompt is None and self.share_prompts and req.output_ids:  # the key it added
                        starting.pop(tuple(req.prompt_ids), None)
                continue
            free -= need
            needs.append(need)
            work.append(_Work(i, req, seq, self._agreed(seq, req), k))
        if not work:
            return drafts
        self._allocate(work, needs)
        draws = DraftDraws(
            [w.req for w in work],
            self.model.args.vocab_size,
            self.device,
            self.runner.fused_kernels,
            self.runner.graphs,
        )
        # Every draft token stays on the device until all are drawn: one read for the whole proposal.
        column = self._catch_up(work, draws)
        columns = [column]
        for step in range(1, max(w.k for w in work)):  # decode steps, each feeding the newest drafts
            active = [j for j, w in enumerate(work) if w.k > step]
            subset = len(active) < len(work)
            index = host_to_device(np.asarray(active, dtype=np.int64), self.device) if subset else None
            fed = column[index] if index is not None else column
            starts = np.fromiter((work[j].req.seq_len + step - 1 for j in active), np.int64, len(active))
            logits = self._forward([work[j].seq for j in active], np.ones(len(active), np.int64), starts, fed)
            tokens = draws.sample(logits, active, step)
            if index is not None:
                column = column.clone()
                column[index] = tokens
            else:
                column = tokens
            columns.append(column)
        drawn = torch.stack(columns, dim=1).tolist()
        if starting:
            self._share_prompts(work, starting)
        self.draws += draws.made
        self.graphed_draws += draws.graphed
        for w, row in zip(work, drawn):
            drafts[w.index] = row[: w.k]
            w.seq.fed.extend(row[: w.k - 1])  # fed by the decode steps
        return drafts

    def _allocate(self, work: list[_Work], needs: list[int]) -> None:
        """Slots for the positions each sequence will write that its row does not hold yet, in one call."""
        grow = [(w.seq, need) for w, need in zip(work, needs) if need]
        if not grow:
            return
        rows = np.fromiter((seq.row for seq, _ in grow), np.int64, len(grow))
        starts = np.fromiter((seq.slots for seq, _ in grow), np.int64, len(grow))
        self.kv.alloc_extend(rows, starts, np.fromiter((n for _, n in grow), np.int64, len(grow)))
        for seq, need in grow:
            seq.slots += need

    def _catch_up(self, work: list[_Work], draws: DraftDraws) -> torch.Tensor:
        """Feed each request's tokens from its `start` to its last; returns the first draft token of each
        (drawn from its last token's logits), on the device. Where the draft's decode steps replay CUDA
        graphs, the few tokens a verify step kept are fed as decode steps (one graph replay per token, where
        a multi-token forward would run eagerly, layer by layer); longer runs go in chunks."""
        first = torch.zeros(len(work), dtype=torch.long, device=self.device)
        short: list[int] = []
        if self.catch_up_by_decoding:
            short = [j for j, w in enumerate(work) if w.req.seq_len - w.start <= _DECODED_CATCH_UP]
        if short:
            first[self._index(short, len(work))] = self._catch_up_by_decoding(work, short, draws)
        rest = sorted(set(range(len(work))) - set(short))
        if rest:
            first[self._index(rest, len(work))] = self._catch_up_in_chunks(work, rest, draws)
        return first

    def _index(self, picked: list[int], total: int) -> torch.Tensor | slice:
        if len(picked) == total:
            return slice(None)
        return host_to_device(np.asarray(picked, dtype=np.int64), self.device)

    def _catch_up_by_decoding(self, work: list[_Work], picked: list[int], draws: DraftDraws) -> torch.Tensor:
        """Decode steps over the picked requests' new tokens, aligned to end together: step r feeds the
        requests with at least `rounds - r` tokens left. Only the last step's logits are drawn from."""
        left = {j: work[j].req.seq_len - work[j].start for j in picked}
        rounds = max(left.values())
        logits = torch.empty(0)
        for r in range(rounds):
            active = [j for j in picked if left[j] >= rounds - r]
            positions = np.fromiter(
                (work[j].req.seq_len - (rounds - r) for j in active), np.int64, len(active)
            )
            ids = [work[j].req.tokens(int(p), int(p) + 1)[0] for j, p in zip(active, positions)]
            fed = host_to_device(np.asarray(ids, dtype=np.int64), self.device)
            logits = self._forward(
                [work[j].seq for j in active], np.ones(len(active), np.int64), positions, fed
            )
        for j in picked:
            seq, start, end = work[j].seq, work[j].start, work[j].req.seq_len
            del seq.fed[start:]
            seq.fed.extend(work[j].req.tokens(start, end))
            seq.agreed = end
        return draws.sample(logits, picked, 0)

    def _catch_up_in_chunks(self, work: list[_Work], picked: list[int], draws: DraftDraws) -> torch.Tensor:
        """Forwards of at most max_batch_tokens over the picked requests' tokens from their `start`."""
        first = torch.zeros(len(picked), dtype=torch.long, device=self.device)
        todo = [(p, work[j].start) for p, j in enumerate(picked)]
        while todo:
            budget = self.max_batch_tokens
            batch: list[tuple[int, int, int]] = []  # (place in `picked`, start, length)
            rest: list[tuple[int, int]] = []
            for p, start in todo:
                end = work[picked[p]].req.seq_len
                length = min(end - start, budget)
                if length <= 0:
                    rest.append((p, start))
                    continue
                batch.append((p, start, length))
                budget -= length
                if start + length < end:
                    rest.append((p, start + length))
            ids = [work[picked[p]].req.tokens(start, start + length) for p, start, length in batch]
            lens = np.fromiter((length for *_, length in batch), np.int64, len(batch))
            starts = np.fromiter((start for _, start, _ in batch), np.int64, len(batch))
            ends = starts + lens == np.fromiter(
                (work[picked[p]].req.seq_len for p, *_ in batch), np.int64, len(batch)
            )
            logits = self._forward(
                [work[picked[p]].seq for p, *_ in batch],
                lens,
                starts,
                host_to_device(np.concatenate([np.asarray(t, dtype=np.int64) for t in ids]), self.device),
                (np.cumsum(lens) - 1)[ends],
            )
            done = [p for (p, *_), end in zip(batch, ends) if end]
            if done:
                first[self._index(done, len(picked))] = draws.sample(logits, [picked[p] for p in done], 0)
            for (p, start, _), fed in zip(batch, ids):
                seq = work[picked[p]].seq
                del seq.fed[start:]
                seq.fed.extend(fed)
                seq.agreed = len(seq.fed)
            todo = rest
        return first

    def _forward(
        self,
        seqs: list[DraftSequence],
        lens: np.ndarray,
        starts: np.ndarray,
        input_ids: torch.Tensor,
        logit_rows: np.ndarray | None = None,
    ) -> torch.Tensor:
        """One forward of the draft over lens[i] tokens (packed in `input_ids`, on the device) at positions
        starts[i].. of sequence seqs[i]; returns the logits of the tokens at `logit_rows` of the packed
        tokens (None: every token, one per sequence, a decode step)."""
        dev = self.device
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
        positions = concat_ranges(starts, lens)
        flat = np.repeat(rows, lens) * self.table.max_context + positions
        device_positions, at = host_to_device(np.stack([positions, flat]), dev)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=device_positions,
            out_slots=self.table.table.view(-1)[at].long(),
            rows=rows.tolist(),
            q_lens=lens.tolist(),
            kv_lens=(starts + lens).tolist(),
            sample_index=torch.arange(len(seqs), device=dev)
            if logit_rows is None
            else host_to_device(logit_rows, dev),
            every_token_samples=logit_rows is None,
        )
        if self.clamp_ids:
            batch.input_ids = input_ids.clamp(max=self.model.args.vocab_size - 1)
        logits, _ = self.runner.forward(batch)
        return logits
