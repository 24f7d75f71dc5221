"""Stop strings (``SamplingParams.stop``): a completion ends where its text first contains one.

Text is a property of tokens *and* a tokenizer, which the scheduler does not have (it imports no
tokenizer, as it imports no torch), so the check runs after each step in the engine that owns the
tokenizer, as vLLM's detokenizer does: each watched sequence's new tokens are detokenized
incrementally and the new text searched, together with the tail of the old text that a stop string
could straddle. On a match the sequence is finished at once with ``finish_reason="stop"`` (its blocks
freed before the next step plans) and its text cut before the stop string (``include_stop_str_in_output``
keeps it); its token ids keep every token generated, the one that completed the stop string last.

A sequence that ended in the same step for another reason (EOS, ``max_tokens``) is checked too: a stop
string in its last text wins, as the text a client reads ends there. Like EOS, stop strings do not end
a completion before ``min_tokens``.
"""

from __future__ import annotations

from pagedbench.refengine.engine.detokenizer import IncrementalDetokenizer
from pagedbench.refengine.engine.sequence import Sequence, SequenceStatus


def find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The earliest ``(index, stop)`` of a stop string in ``text`` that ends past ``start`` (the text
    already searched), else None. Among stops found at one index, the longest."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
            best = (i, stop)
    return best


class _Watch:
    __slots__ = ("detok", "num_tokens", "text")

    def __init__(self, tokenizer) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.num_tokens = 0  # output tokens detokenized
        self.text = ""


class StopStringWatcher:
    """Every live sequence whose request has stop strings, and the text it has produced so far."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._watched: dict[int, tuple[Sequence, _Watch]] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, seqs) -> None:
        for seq in seqs:
            if seq.params.stop:
                self._watched[seq.seq_id] = (seq, _Watch(self.tokenizer))

    def check(self, finish_now) -> list[Sequence]:
        """Detokenize what each watched sequence generated since the last call and end those whose text
        now holds a stop string, through ``finish_now(seq, "stop")`` for one still running or waiting.
        Returns the sequences it ended (those already finished in the step included, their reason now
        "stop"). Sequences that ended otherwise (aborted, or finished without a stop string) are dropped."""
        ended, gone = [], []
        for seq_id, (seq, w) in self._watched.items():
            n = seq.num_output_tokens
            if n < w.num_tokens:  # a rolled-back step took tokens back: read its text again
                w = _Watch(self.tokenizer)
                self._watched[seq_id] = (seq, w)
            finished = seq.status is SequenceStatus.FINISHED
            if n > w.num_tokens:
                searched = len(w.text)
                w.text += w.detok.add(seq.token_ids[seq.num_prompt_tokens + w.num_tokens:], final=finished)
                w.num_tokens = n
                found = find_stop(w.text, seq.params.stop, searched) if n >= seq.params.min_tokens else None
                if found is not None and (not finished or seq.finish_reason != "abort"):
                    at, stop = found
                    seq.output_text = w.text[:at + len(stop)] if seq.params.include_stop_str_in_output \
                        else w.text[:at]
                    if finished:
                        seq.finish_reason = "stop"
                    else:
                        finish_now(seq, "stop")
                    ended.append(seq)
                    gone.append(seq_id)
                    continue
            if seq.status is SequenceStatus.FINISHED:
                gone.append(seq_id)
        for seq_id in gone:
            del self._watched[seq_id]
        return ended
