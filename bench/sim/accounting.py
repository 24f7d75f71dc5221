"""The simulator's memory accounting: what each step's KV memory holds, taken as the model would run it.

Accounting, in slots, taken on every step as the model would run it, for each running sequence with
``t`` tokens in its table, ``f`` tokens when done (prompt + output - 1: the last sampled token is never
stored), holding ``h`` slots::

    token states    t
    reserved        min(h, f) - t       held, and will be filled by this request later
    internal frag.  h - min(h, f)       held, never to be filled (over-reservation, buddy rounding,
                                        the unused tail of a paged request's last block)
    external frag.  the free slots, on a step where the queue's head waits although the free slots in
                    total would hold its footprint (no hole fits: only the arena has this)
    free            every other free slot

The five add up to the pool's slots on every step; shares are their time averages over the measured
steps (those starting inside the window).
"""

from __future__ import annotations

import dataclasses

from pagedbench.bench.sim.records import CopyRecord, StepRecord
from pagedbench.refengine.engine.core import SimulatedExecutor, StepResult, StepShape


class AccountingExecutor:
    """An executor wrapper that sees the KV memory of each step once it is planned, before it runs: its
    peak use, and (``account``) its accounting (see the module docstring); it decides nothing. A step
    that swaps blocks lasts as much longer as ``run.block_copy_s(num_out, num_in)`` prices its copies,
    and one with host-tier copies as much longer as ``run.block_copy_s(num_stored, num_loaded)`` prices
    those (they run before the model, as the engine's executor applies them)."""

    def __init__(self, inner: SimulatedExecutor, run, account: bool) -> None:
        self.inner, self.run, self.do_account = inner, run, account

    def execute(self, out) -> StepResult:
        run = self.run
        used = run.bm.num_used_blocks
        if used > run.peak_used:
            run.peak_used = used
        copy = 0.0
        if out.swap_out or out.swap_in or out.offload_store or out.offload_load:  # the step waits for its copies
            if run.block_copy_s is not None:
                if out.swap_out or out.swap_in:
                    copy = run.block_copy_s(len(out.swap_out), len(out.swap_in))
                if out.offload_store or out.offload_load:  # a batch of their own, as the executor applies them
                    copy += run.block_copy_s(len(out.offload_store), len(out.offload_load))
                run.copy_s += copy
            run.copies.append(CopyRecord(run.clock.now(), len(out.swap_out), len(out.swap_in), copy,
                                         len(out.offload_store), len(out.offload_load)))
        if run.host_hits is not None:
            note_host_hits(run, out)
        if self.do_account:
            account_step(run)
        result = self.inner.execute(out)
        extra = copy
        if run.wake_left:  # one of the first steps after the engine waited idle
            extra += run.wake_left.pop()
        if run.after_prefill is not None:  # one of the first decode steps after a prefill
            extra += run.after_prefill.extra(StepShape.of(out))
        return dataclasses.replace(result, elapsed_s=result.elapsed_s + extra) if extra else result


def note_host_hits(run, out) -> None:
    """Each sequence first scheduled in step ``out``: the prompt tokens its admission loaded from the host
    tier, in ``run.host_hits``. A loaded block is the loader's alone: a sequence admitted after it in the
    same step finds it published on the device (a device hit), so it counts for the first table holding it."""
    hits, bm, bs = run.host_hits, run.bm, run.bs
    loaded = {s.dst for s in out.offload_load}
    for c in out.chunks:
        seq_id = c.seq.seq_id
        if seq_id in hits:
            continue
        n = 0
        if loaded:
            mine = loaded.intersection(bm.block_table(seq_id))
            loaded -= mine
            n = len(mine) * bs
        hits[seq_id] = n


def account_step(run) -> None:
    """Adds the step about to run to ``run``'s accounting (the module docstring): its five shares
    of the pool, when it starts inside the window, and its :class:`StepRecord` when steps are recorded."""
    sched, bm, bs = run.sched, run.bm, run.bs
    tok = res = inte = rnd = 0
    paged = run.spec.kind == "paged"
    for seq in sched.running:
        t = seq.num_table_tokens
        if paged:
            h = -(-t // bs) * bs
        else:
            h = bm.held_blocks(seq.seq_id) * bs
            rnd += h - -(-bm.reserved_tokens(seq.seq_id) // bs) * bs
        f = seq.num_prompt_tokens + seq.params.max_tokens - 1
        u = h if h < f else f
        tok += t
        res += u - t
        inte += h - u
    held = tok + res + inte
    if not run.cfg.enable_prefix_caching and held != bm.num_used_blocks * bs:
        raise AssertionError(f"accounting drift: requests hold {held} slots, the allocator "
                             f"{bm.num_used_blocks * bs}")
    free = run.total - held
    ext = 0
    if not paged and sched.waiting and len(sched.running) < sched.max_num_seqs:
        head = sched.waiting[0]
        need = bm.footprint_blocks(head.num_tokens, output_len=head.params.max_tokens - head.num_output_tokens)
        if bm.num_free_blocks >= need:
            ext = free
    row = (tok, res, inte, rnd, ext, free - ext)
    now = run.clock.now()
    if run.window[0] <= now <= run.window[1]:
        run.num_measured += 1
        run.running_sum += len(sched.running)
        run.sums = [a + b for a, b in zip(run.sums, row)]
    if run.record:
        run.steps.append(StepRecord(now, *row, len(sched.running), len(sched.waiting)))
