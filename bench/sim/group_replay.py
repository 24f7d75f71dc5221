"""Request groups in the serving simulator: ``n`` parallel samples, or a beam search of width ``W``.

A group is one request of the engine whose ``n`` (or ``W``) sequences run on the real scheduler and KV
manager. Parallel sampling needs nothing here: the engine forks a request's children once its prompt is
computed (paged) or queues every child with its own reservation (Orca, which cannot fork).

Beam search has no model to choose its beams, so :class:`BeamReplay` replays recorded *trajectories*:
per round, the kept beams as indices into the round before's beams (what ``LLM.beam_search`` records
as ``history``). It plays the part :class:`~pagedbench.refengine.engine.beam_search.BeamSearchRun` plays
beside the model, with the same engine calls:

- a beam samples nothing in the step that computes its last token (it hands over a "row"); once every
  beam of the request has, the request advances one round;
- a beam not kept is freed at once (``Scheduler.finish_now``); a beam kept once is extended in place;
  a beam kept again forks (``Scheduler.fork``); at the first round the prompt's siblings (forked from
  the prompt by the scheduler on the paged manager, or holding their own reservation on Orca's) take
  the place of forks; every kept beam then appends one token;
- the request ends when its beams reach the output length (``ignore_eos``: every beam runs to the end).

Unlike the engine's search, beams not kept are freed *before* the forks: on the paged manager this
changes nothing (a fork takes no block), and on Orca's it lets a fork take the hole its pruned sibling
left. Request ``i`` replays trajectory ``i % len(trajectories)``, cycling through its rounds after the
first when the output is longer (as the memory study does).

On Orca's manager a fork cannot share: :class:`PerBeamContiguousManager` gives the child a reservation
of its own, as large as its parent's, holding a copy of the parent's tokens (Orca reserves for every
beam, as the vLLM paper's baselines did). Copies cost no step time in the simulation, on either manager.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedbench.refengine import ContiguousBlockManager
from pagedbench.refengine.engine.core import SimulatedExecutor, StepResult, StepShape
from pagedbench.refengine.engine.sequence import Sequence, SequenceStatus
from pagedbench.refengine.errors import InvalidArgumentError

KINDS = ("sample", "parallel", "beam")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """How each request of a trace decodes: ``sample`` (one sequence), ``parallel`` (``width`` samples)
    or ``beam`` (a search of ``width`` beams replaying ``trajectories``)."""

    kind: str = "sample"
    width: int = 1
    # per recorded search, per round, the kept beams as indices into the round before's beams
    trajectories: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"group kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise InvalidArgumentError(f"group width must be an int >= 1, got {self.width!r}")
        if self.kind == "sample" and self.width != 1:
            raise InvalidArgumentError(f"kind 'sample' has width 1, got {self.width}")
        if self.kind == "beam":
            check_trajectories(self.trajectories, self.width)

    @property
    def name(self) -> str:
        return {"sample": "n=1", "parallel": f"n={self.width}", "beam": f"beam={self.width}"}[self.kind]

    @property
    def is_beam(self) -> bool:
        return self.kind == "beam"


def check_trajectories(trajectories, width: int) -> None:
    """Every round keeps ``width`` beams, each an index into the round before's; the first round's
    into the prompt (0) alone; at least two rounds per search (the cycle needs one after the first)."""
    if not trajectories:
        raise InvalidArgumentError("beam groups need at least one recorded trajectory")
    for i, traj in enumerate(trajectories):
        if len(traj) < 2:
            raise InvalidArgumentError(f"trajectory {i}: needs at least 2 rounds, got {len(traj)}")
        before = 1
        for t, kept in enumerate(traj):
            if len(kept) != width or any(not 0 <= k < before for k in kept):
                raise InvalidArgumentError(f"trajectory {i}, round {t}: expected {width} indices in [0, {before}), "
                                           f"got {list(kept)}")
            before = width


class PerBeamContiguousManager(ContiguousBlockManager):
    """Orca's manager for beam search: a fork is a reservation of the child's own, as large as the
    parent's, holding a copy of the parent's tokens (nothing is shared). ``num_fork_copies`` and
    ``num_copied_tokens`` count them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_fork_copies = 0
        self.num_copied_tokens = 0

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        num_tokens = self.num_tokens(parent_id)
        self.allocate(child_id, [0] * num_tokens, reserve_tokens=self.reserved_tokens(parent_id))
        self.num_fork_copies += 1
        self.num_copied_tokens += num_tokens


class RowExecutor:
    """A simulated executor for beam groups: steps take the cost model's time and sample nothing (a
    beam's next token is chosen by :class:`BeamReplay` once its whole request has its rows)."""

    def __init__(self, inner: SimulatedExecutor) -> None:
        self.step_time_s = inner.step_time_s

    def execute(self, out) -> StepResult:
        return StepResult({}, self.step_time_s(StepShape.of(out)))


class _Group:
    __slots__ = ("beams", "next_child_index", "request", "round", "spares", "trajectory")

    def __init__(self, request, trajectory: Seq[Seq[int]]) -> None:
        self.request = request
        self.beams: list[Sequence] = [request.children[0]]
        self.spares: list[Sequence] = list(request.children[1:])  # the prompt's siblings, until round 0
        self.trajectory = trajectory
        self.round = 0  # rounds done = output tokens of every live beam
        self.next_child_index = len(request.children)

    def kept(self) -> Seq[int]:
        t, traj = self.round, self.trajectory
        return traj[0] if t == 0 else traj[1 + (t - 1) % (len(traj) - 1)]

    def ready(self) -> bool:
        """Every live beam (and sibling) holds its blocks with every token computed: its row is out."""
        running = SequenceStatus.RUNNING
        return all(s.status is running and s.num_computed_tokens == len(s.token_ids)
                   for s in (*self.beams, *self.spares))


class BeamReplay:
    """Drives the beam groups of a simulated run (module docstring): :meth:`add` each request as it is
    queued, :meth:`after_step` after every engine step. ``num_forks`` counts forks made (siblings placed
    at round 0 not included), ``num_pruned`` beams freed before the end, ``num_generated`` tokens
    appended by kept beams."""

    def __init__(self, core, spec: GroupSpec, filler_token: int = 0) -> None:
        self.core = core
        self.sched = core.scheduler
        self.spec = spec
        self.filler = filler_token
        self._groups: dict[int, _Group] = {}  # request_id -> its live search
        self.num_forks = 0
        self.num_pruned = 0
        self.num_generated = 0  # tokens the kept beams appended

    def add(self, request) -> None:
        traj = self.spec.trajectories[request.request_id % len(self.spec.trajectories)]
        self._groups[request.request_id] = _Group(request, traj)

    def after_step(self, report) -> list:
        """Advance every request whose beams all computed their rows in this step; returns the requests
        that ended (their sequences freed, ``finish_s`` = the step's end)."""
        groups = self._groups
        touched: list[_Group] = []
        for c in report.output.chunks:
            if c.samples:
                g = groups.get(c.seq.request_id)
                if g is not None and g not in touched:
                    touched.append(g)
        done = []
        for g in touched:
            if g.ready() and self._advance(g, report.end_s):
                done.append(g.request)
                del groups[g.request.request_id]
                self.core.requests.pop(g.request.request_id, None)
        return done

    def _advance(self, g: _Group, now: float) -> bool:
        sched = self.sched
        kept = g.kept()
        used = set(kept)
        for i, beam in enumerate(g.beams):
            if i not in used:  # pruned: freed at once
                self._end(beam, "pruned", now)
        placed: set[int] = set()
        beams = []
        for parent_index in kept:
            parent = g.beams[parent_index]
            if parent_index not in placed:  # extended in place
                placed.add(parent_index)
                seq = parent
            elif g.spares:  # round 0: a sibling already holding the prompt
                seq = g.spares.pop(0)
            else:
                seq = Sequence(self.core.next_seq_id, parent.request_id, g.next_child_index, list(parent.token_ids),
                               parent.num_prompt_tokens, parent.params, None)
                self.core.next_seq_id += 1
                g.next_child_index += 1
                sched.fork(parent, seq)
                g.request.children.append(seq)
                self.num_forks += 1
            beams.append(seq)
        for s in g.spares:  # siblings no round-0 beam needed
            self._end(s, "pruned", now)
        g.spares = []
        for seq in beams:
            seq.token_ids.append(self.filler)
        g.beams = beams
        self.num_generated += len(beams)
        g.round += 1
        if g.round < g.request.params.max_tokens:
            return False
        for seq in beams:
            self._end(seq, "length", now)
        return True

    def _end(self, seq: Sequence, reason: str, now: float) -> None:
        self.sched.finish_now(seq, reason)
        seq.finish_s = now
        if reason == "pruned":
            self.num_pruned += 1


__all__ = ["KINDS", "BeamReplay", "GroupSpec", "PerBeamContiguousManager", "RowExecutor", "check_trajectories"]
