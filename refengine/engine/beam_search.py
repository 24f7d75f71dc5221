"""Beam search on the block manager, as the paper's system ran it: a prompt's beams are the sequences of
one request, sharing blocks through ``fork``.

Each engine step, every live beam that computed its last token hands over its logits row; once all the
beams of a request have one, the request advances (:func:`select_candidates`, vLLM's rule):

- each beam's ``2 * beam_width`` most likely next tokens are candidates, scored by the beam's cumulative
  log-probability plus the token's (a log-softmax over the vocabulary, after ``temperature``);
- an EOS candidate (unless ``ignore_eos``) becomes a finished sequence and is never extended;
- the ``beam_width`` best other candidates, over every beam, are the next beams. A beam kept once is
  extended in place; a beam kept again forks (the child shares every block; the next step's append into
  a shared partial block copies it on write); a beam not kept is freed at once.

A request ends when its beams reach ``max_tokens``; its finished sequences and its last beams are then
ranked by :func:`~pagedbench.refengine.engine.beam_params.beam_score` and the best ``beam_width`` returned.
There is no early stop (vLLM's rule, not transformers' ``early_stopping``); with ``ignore_eos`` both give
the same beams. At the first step the prompt's ``beam_width - 1`` siblings are forked exactly as
``n > 1`` children are (the scheduler forks a request's pending children when its prompt is computed),
which also makes the request count ``beam_width`` seats at admission.

The scheduler preempts a request's beams together and re-admits them together; a beam that computed
its row before its siblings waits for them (holding its blocks, planned no work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedbench.refengine.engine.beam_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from pagedbench.refengine.engine.sampling_params import SamplingParams
from pagedbench.refengine.engine.sequence import Sequence
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError


@dataclass(frozen=True, slots=True)
class Candidate:
    """One continuation: beam ``beam`` (an index into the rows given) extended by ``token``."""

    beam: int
    token: int
    logprob: float  # the token's log-probability under the beam's row
    cum_logprob: float  # the beam's cumulative log-probability plus ``logprob``


def select_candidates(cum_logprobs: list[float], logprobs: torch.Tensor, beam_width: int,
                      eos_token_ids: frozenset[int]) -> tuple[list[Candidate], list[Candidate]]:
    """``(kept, finished)`` for one request's step (vLLM's rule, module docstring).

    ``logprobs``: ``[num_beams, vocab]`` log-probabilities, one row per beam, in the order of
    ``cum_logprobs``. ``kept``: the ``beam_width`` best non-EOS candidates, best first (ties keep beam
    order, then the row's top-k order). ``finished``: every EOS candidate among each beam's top
    ``2 * beam_width`` (empty when ``eos_token_ids`` is: ``ignore_eos``).
    """
    k = min(2 * beam_width, logprobs.shape[-1])
    top_lp, top_tok = logprobs.topk(k, dim=-1)
    kept: list[Candidate] = []
    finished: list[Candidate] = []
    for b, (lps, toks) in enumerate(zip(top_lp.tolist(), top_tok.tolist())):
        for lp, tok in zip(lps, toks):
            c = Candidate(b, tok, lp, cum_logprobs[b] + lp)
            (finished if tok in eos_token_ids else kept).append(c)
    kept.sort(key=lambda c: -c.cum_logprob)
    return kept[:beam_width], finished


class _Beam:
    """A live beam: its sequence and what the search scored it with."""

    __slots__ = ("cum_logprob", "logprobs", "seq")

    def __init__(self, seq: Sequence, logprobs: list[float], cum_logprob: float) -> None:
        self.seq = seq
        self.logprobs = logprobs  # one per generated token
        self.cum_logprob = cum_logprob


class _Group:
    """One prompt's search: its live beams, the rows they computed this round, its finished sequences."""

    __slots__ = ("beams", "done", "finished", "history", "next_child_index", "params", "rows", "spares")

    def __init__(self, first: Sequence, spares: list[Sequence], params: BeamSearchParams) -> None:
        self.params = params
        self.beams = [_Beam(first, [], 0.0)]
        self.spares = spares  # the prompt's siblings, forked with it, until the first step places them
        self.rows: dict[int, torch.Tensor] = {}  # seq_id -> logits row of a beam that computed its last token
        self.finished: list[tuple[list[int], list[float], float, str]] = []  # tokens, logprobs, cum, reason
        self.next_child_index = params.beam_width
        self.done = False
        # each round's kept candidates as indices into the previous round's beams: the search's shape,
        # which a study replays on a block manager without the model
        self.history: list[list[int]] = []


class BeamSearchRun:
    """Runs one ``LLM.beam_search`` call on the engine's scheduler and model executor."""

    def __init__(self, core, scheduler, executor, eos_token_ids: frozenset[int], *, on_step=None) -> None:
        self.core = core
        self.scheduler = scheduler
        self.executor = executor
        self.eos_token_ids = eos_token_ids
        self.on_step = on_step  # called with each step's SchedulerOutput (stats, invariant checks)
        self.groups: list[_Group] = []
        self._by_seq: dict[int, _Group] = {}

    def add(self, token_ids: list[int], params: BeamSearchParams, *, cache_salt: str | None = None) -> None:
        """Queue one prompt: a request of ``beam_width`` sequences, all but one forked at its first step.
        The search handles EOS itself, so the scheduler never ends a beam (``ignore_eos``) but at
        ``max_tokens``."""
        sp = SamplingParams(max_tokens=params.max_tokens, n=params.beam_width, ignore_eos=True)
        req = self.core.new_request(token_ids, sp, cache_salt=cache_salt)
        group = _Group(req.children[0], list(req.children[1:]), params)
        for s in req.children:
            self._by_seq[s.seq_id] = group
        self.groups.append(group)
        self.core.add(req)

    def run(self) -> None:
        """Step until every request has ended. A failed step leaves no sequence or block behind."""
        scheduler, executor = self.scheduler, self.executor
        try:
            while scheduler.has_unfinished():
                out = scheduler.schedule()
                for seq_id in out.preempted_seq_ids:  # recomputed from scratch: its row comes again
                    self._by_seq[seq_id].rows.pop(seq_id, None)
                executor.apply_copies(out)
                seqs, logits = executor.forward_logits(out)
                scheduler.update(out, {})
                ready = []
                for i, seq in enumerate(seqs):
                    group = self._by_seq[seq.seq_id]
                    group.rows[seq.seq_id] = logits[i]
                    if all(b.seq.seq_id in group.rows for b in group.beams) and group not in ready:
                        ready.append(group)
                for group in ready:
                    self._advance(group)
                if self.on_step is not None:
                    self.on_step(out)
        except BaseException:
            scheduler.abort_all()
            raise

    def outputs(self, tokenizer=None) -> list[BeamSearchOutput]:
        return [self._output(g, tokenizer) for g in self.groups]

    # --- one round of one request ------------------------------------------------------------------
    def _advance(self, group: _Group) -> None:
        p = group.params
        rows = torch.stack([group.rows.pop(b.seq.seq_id) for b in group.beams]).to(torch.float64)
        if p.temperature > 0:
            rows = rows / p.temperature
        logprobs = torch.log_softmax(rows, dim=-1)
        eos = frozenset() if p.ignore_eos else self.eos_token_ids
        kept, ended = select_candidates([b.cum_logprob for b in group.beams], logprobs, p.beam_width, eos)
        group.history.append([c.beam for c in kept])
        for c in ended:
            beam = group.beams[c.beam]
            group.finished.append(([*beam.seq.token_ids, c.token], [*beam.logprobs, c.logprob], c.cum_logprob,
                                   "eos"))
        before = [list(b.seq.token_ids) for b in group.beams]  # each beam's tokens before this round
        used = [False] * len(group.beams)
        beams: list[_Beam] = []
        for c in kept:
            parent = group.beams[c.beam]
            if not used[c.beam]:  # extended in place
                used[c.beam] = True
                seq = parent.seq
            elif group.spares:  # first round: a sibling forked with the prompt
                seq = group.spares.pop(0)
            else:
                seq = self._fork(group, parent.seq, before[c.beam])
            seq.token_ids.append(c.token)
            beams.append(_Beam(seq, [*parent.logprobs, c.logprob], c.cum_logprob))
        for b, was_used in zip(group.beams, used):
            if not was_used:
                self.scheduler.finish_now(b.seq, "pruned")
        for s in group.spares:
            self.scheduler.finish_now(s, "pruned")
        group.spares = []
        group.beams = beams
        if not beams or beams[0].seq.num_output_tokens >= p.max_tokens:
            for b in beams:
                group.finished.append((list(b.seq.token_ids), b.logprobs, b.cum_logprob, "length"))
                self.scheduler.finish_now(b.seq, "length")
            group.beams = []
            group.done = True

    def _fork(self, group: _Group, parent: Sequence, tokens: list[int]) -> Sequence:
        core = self.core
        child = Sequence(core.next_seq_id, parent.request_id, group.next_child_index, list(tokens),
                         parent.num_prompt_tokens, parent.params, None, cache_salt=parent.cache_salt)
        core.next_seq_id += 1
        group.next_child_index += 1
        self._by_seq[child.seq_id] = group
        self.scheduler.fork(parent, child)
        return child

    def _output(self, group: _Group, tokenizer) -> BeamSearchOutput:
        p = group.params
        eos = frozenset() if p.ignore_eos else self.eos_token_ids  # an ignored EOS is a token like any
        ranked = sorted(group.finished, key=lambda h: -beam_score(h[0], h[2], eos, p.length_penalty))
        seqs = []
        for tokens, logprobs, cum, reason in ranked[:p.beam_width]:
            text = tokenizer.decode(tokens) if tokenizer is not None else None
            seqs.append(BeamSearchSequence(tokens, logprobs, cum, reason, text))
        return BeamSearchOutput(seqs)


def beam_request_error(num_prompt_tokens: int, params: BeamSearchParams, *, block_size: int, num_blocks: int,
                       max_num_seqs: int, max_model_len: int, vocab_size: int) -> str | None:
    """Why the engine can never serve this prompt's search (None: it can).

    The pool must hold every beam on blocks of its own (``beam_width`` x the blocks of ``prompt +
    max_tokens - 1`` tokens): a preempted request is recomputed beam by beam, sharing nothing.
    """
    w = params.beam_width
    if w > max_num_seqs:
        return f"beam_width={w} exceeds max_num_seqs={max_num_seqs} (every beam is a running sequence)"
    if 2 * w > vocab_size:
        return f"beam_width={w} needs 2 * beam_width <= the vocabulary's {vocab_size} tokens"
    held = num_prompt_tokens + params.max_tokens - 1  # the last token's KV is never stored
    if held > max_model_len:
        return (f"prompt of {num_prompt_tokens} tokens + max_tokens={params.max_tokens} exceeds "
                f"max_model_len={max_model_len}")
    per_beam = -(-held // block_size)
    if w * per_beam > num_blocks:
        return (f"beam_width={w} can never fit the KV pool: {w} beams of up to {held} tokens need "
                f"{w} x {per_beam} blocks unshared (after a preemption), the pool has {num_blocks}; "
                f"beam_width <= {num_blocks // per_beam} fits")
    return None


def run_beam_search(llm, prompts, params: BeamSearchParams, *, history: list | None = None
                    ) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: validate everything, then run the search on ``llm``'s engine. ``history``: a
    list given here gets, per prompt, each round's kept beams as indices into the round before's."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidArgumentError(
            f"beam_search takes BeamSearchParams(beam_width, max_tokens, ...), got {type(params).__name__}: "
            "beam search honours no sampling option (n, top_p, top_k, seed, stop_token_ids)")
    if llm.allocator != "paged":
        raise InvalidArgumentError(f"beam search needs the paged allocator (beams share blocks through fork); "
                                   f"this LLM has allocator={llm.allocator!r}")
    prompt_list, _ = llm.normalise_prompts(prompts, None)
    ids_list, bad = [], []
    for i, prompt in enumerate(prompt_list):
        ids, salt, error = llm.prepare_prompt(prompt, SamplingParams(max_tokens=params.max_tokens))
        if error is None:
            error = beam_request_error(
                len(ids), params, block_size=llm.block_size, num_blocks=llm.block_manager.num_blocks,
                max_num_seqs=llm.max_num_seqs, max_model_len=llm.max_model_len,
                vocab_size=llm.config.vocab_size)
        if error is not None:
            bad.append(f"prompt {i}: {error}")
        ids_list.append((ids, salt))
    if bad:
        raise InvalidRequestError(f"{len(bad)} of {len(prompt_list)} prompts rejected: {'; '.join(bad)}")

    def on_step(out) -> None:
        llm._recorder.step(out, sum(1 for c in out.chunks if c.samples), llm.scheduler, llm.block_manager)
        if llm.check_invariants:
            llm.block_manager.check_invariants()

    search = BeamSearchRun(llm.core, llm.scheduler, llm.executor, llm.scheduler.stop.eos_token_ids,
                           on_step=on_step)
    for ids, salt in ids_list:
        search.add(ids, params, cache_salt=salt)
    search.run()
    llm._check_no_leak()
    if history is not None:
        history.extend(g.history for g in search.groups)
    return search.outputs(llm.tokenizer)
