"""The step time of the CPU engine's batched attention (``torch-batched``): the linear terms plus the cost
of its attention groups and of their padding.

That backend (``refengine.model.batched_attention``) splits a step's sequences into groups: the decodes
bucketed by the power of two at or above ``max(seq_len, MIN_DECODE_BUCKET)``, and every prefill chunk in
one group. Each group is gathered and attended as one padded tensor, ``S`` sequences x ``Mq`` queries x
``L`` keys (``L`` the group's longest sequence, so within a bucket no sequence is padded past twice its
length), once per layer. So on top of :data:`calibration.TERMS` a step costs::

    + g     x number of attention groups                 (a gather and an SDPA call per layer each)
    + k_pad x sum over decode groups of S x L             (padded keys gathered and attended)
    + p_pad x S x Mq x L of the prefill group             (the padded score matrix, causal mask or not)
    + f     x 1 if the step has a prefill group           (what that group does beyond a decode group:
                                                           its queries scattered into a padded tensor, its
                                                           causal mask built and expanded per query head,
                                                           its outputs gathered back, per layer)

The real-work terms beside the padded ones (per decode context token, per causal prefill pair) stay for
the costs that follow a sequence's real length rather than its group's padding; the data decides
between them only where the two differ: decode groups whose members differ in length, prefill groups of
unlike chunks, a chunk after a cached context.

:func:`attention_groups` computes the groups from a :class:`StepBatch` the way the backend does, so
the simulator pays for a step what the engine pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pagedbench.bench.costmodel.step_cost import StepBatch
from pagedbench.refengine.model.batched_attention import MIN_DECODE_BUCKET

#: the linear terms (``calibration.TERMS``) and the four of the batched backend, in design-matrix order
BATCHED_TERMS = ("fixed_s", "linear_compute_s_per_token", "lm_head_s_per_sampled_token",
                 "decode_attn_s_per_context_token", "prefill_attn_s_per_pair",
                 "attn_group_s", "decode_attn_s_per_padded_key", "prefill_attn_s_per_padded_pair",
                 "prefill_group_s")


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """One padded group of a step: ``num_seqs`` x ``max_query_len`` queries x ``max_seq_len`` keys."""

    num_seqs: int
    max_query_len: int  # 1 for a decode bucket
    max_seq_len: int  # the group's longest sequence, its new tokens included


def attention_groups(batch: StepBatch) -> tuple[AttentionGroup, ...]:
    """The groups the batched backend forms for ``batch``: decode buckets (shortest first), then prefill.

    A prefill chunk of one token is a decode to the backend (it groups by query length), so it joins the
    decode buckets with its full length.
    """
    decode_lens = list(batch.decode_context_lens) + [ctx + 1 for q, ctx in batch.prefill_chunks if q == 1]
    groups = []
    if decode_lens:
        lens = np.asarray(decode_lens, dtype=np.int64)
        bucket = np.frexp(np.maximum(lens, MIN_DECODE_BUCKET) - 1)[1]  # ceil(log2), as the backend buckets
        for b in np.unique(bucket):
            members = lens[bucket == b]
            groups.append(AttentionGroup(len(members), 1, int(members.max())))
    chunks = [(q, ctx) for q, ctx in batch.prefill_chunks if q > 1]
    if chunks:
        groups.append(AttentionGroup(len(chunks), max(q for q, _ in chunks), max(q + ctx for q, ctx in chunks)))
    return tuple(groups)


def batched_term_row(batch: StepBatch) -> list[float]:
    """The batch's value of each of :data:`BATCHED_TERMS` (the design-matrix row)."""
    groups = attention_groups(batch)
    padded_keys = sum(g.num_seqs * g.max_seq_len for g in groups if g.max_query_len == 1)
    padded_pairs = sum(g.num_seqs * g.max_query_len * g.max_seq_len for g in groups if g.max_query_len > 1)
    pairs = sum(q * (ctx + 0.5 * (q + 1)) for q, ctx in batch.prefill_chunks)
    has_prefill_group = any(g.max_query_len > 1 for g in groups)
    return [1.0, float(batch.num_tokens), float(len(batch.decode_context_lens) + len(batch.prefill_chunks)),
            float(sum(batch.decode_context_lens)), float(pairs),
            float(len(groups)), float(padded_keys), float(padded_pairs), float(has_prefill_group)]


@dataclass(frozen=True, slots=True)
class BatchedStepCost:
    """Coefficients of :data:`BATCHED_TERMS`, in seconds; the step time is their sum over a batch's row."""

    label: str
    fixed_s: float  # per non-empty step
    linear_compute_s_per_token: float  # every token through every layer
    lm_head_s_per_sampled_token: float  # decode sequences + prefill chunks
    decode_attn_s_per_context_token: float  # a real (unpadded) decode key
    prefill_attn_s_per_pair: float  # a causal (query, key) pair of a prefill chunk
    attn_group_s: float  # one attention group (gather + SDPA per layer)
    decode_attn_s_per_padded_key: float  # a key of a decode group, padding included
    prefill_attn_s_per_padded_pair: float  # a (query, key) of the padded prefill group
    prefill_group_s: float  # the prefill group's own work beyond attn_group_s (scatter, causal mask, gather)

    def step_time_s(self, batch: StepBatch) -> float:
        """Seconds for ``batch``; 0.0 for an empty one."""
        if batch.num_tokens == 0:
            return 0.0
        return float(np.dot([getattr(self, t) for t in BATCHED_TERMS], batched_term_row(batch)))
