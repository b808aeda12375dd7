"""The rollout worker of one rank: many tasks at once on one engine, scheduled by
`vanilla` or `ctb` on the same loop.

Driver loop: observe (the rank's tasks, their footprints and phases) -> decide
(the scheduler) -> act (start admitted tasks, mark pauses, release resumes) ->
wait for the next turn boundary. Tasks run `run_task` as asyncio tasks; a paused
task parks before its next generation, after telling the environment `/pause`
(so its session is not reaped) and says `/resume` when released.

CTB footprints come from the tasks' own token counts: context + the room of the
next generation. A group's first task is its probe: the group's other tasks are
admitted with the probe's measured first-turn footprint.

With an adaptive budget (`budget_limits`), the worker judges every turn of a task
that stayed resident since its previous generation: did the engine serve that
context from its prefix cache (`Generation.num_cached_tokens`)? Once a window of
turns is judged, `tiderl.policy.ctb_budget.next_budget` sets the next budget:
it grows while the budget holds tasks back and the cache keeps what the resident
tasks left in it, and shrinks when it evicts them; where the worker's `CostMeter`
has fitted what a re-prefilled token costs (from the engine's timed iterations,
`Engine.take_iterations`), by what the evicted contexts cost
against what the overcommit could add. The bookkeeping is
`tiderl.policy.ctb_budget.BudgetTracker`, which the simulator's rollout ranks
keep the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

from tiderl.policy.ctb import AdmissionLimits, CandidateGroup, CtbDecision, CtbTask, RankView, TaskState
from tiderl.policy.ctb_budget import BudgetLimits, BudgetTracker, CostMeter
from tiderl.rollout.agent_loop import LoopLimits, Phase, TaskRun, progress_of, run_task
from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import Engine
from tiderl.rollout.local_env import EnvLink
from tiderl.rollout.schedulers import Scheduler
from tiderl.rollout.trajectory import GroupSpec, TaskProgress, TaskSpec, Trajectory

Sink = Callable[[Trajectory], Awaitable[None] | None]
OnFailure = Callable[[TaskSpec, BaseException], None]


@dataclasses.dataclass(kw_only=True, slots=True)
class WorkerReport:
    num_tasks: int = 0
    num_admitted: int = 0
    num_pauses: int = 0
    num_resumes: int = 0
    num_generated_tokens: int = 0
    max_resident_tasks: int = 0
    reward_sum: float = 0.0
    wall_s: float = 0.0
    prefix_kept_turns: int = 0
    """Turns of resident tasks whose previous context came back from the prefix cache."""
    prefix_evicted_turns: int = 0
    """Turns of resident tasks whose previous context had been evicted."""
    max_budget_tokens: int = 0
    """The largest CTB budget in force (the adaptive budget's high-water mark)."""

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.num_tasks if self.num_tasks else 0.0


class RolloutWorker:
    def __init__(
        self,
        engine: Engine,
        env: EnvLink,
        fmt: ChatFormat,
        scheduler: Scheduler,
        limits: LoopLimits,
        *,
        sink: Sink | None = None,
        budget_tokens: int | None = None,
        max_resident_tasks: int | None = None,
        staleness_allowance: Callable[[], int | None] | None = None,
        on_failure: OnFailure | None = None,
        budget_limits: BudgetLimits | None = None,
    ) -> None:
        """``budget_tokens``: CTB's KV budget (default: the engine's capacity).
        ``max_resident_tasks``: this rank's environment concurrency cap.
        ``staleness_allowance``: training tasks that may still start within the staleness
        bound (asked before every decision; None: unbounded).
        ``on_failure``: told of a task that failed, the others carry on (a long-lived rank);
        None: the first failure stops the worker (`run` raises it).
        ``budget_limits``: adapt CTB's budget from the engine's cache (its floor is the budget above);
        None: the budget stays fixed."""
        self.engine, self.env, self.fmt, self.scheduler, self.limits = engine, env, fmt, scheduler, limits
        self.sink = sink
        floor = budget_tokens if budget_tokens is not None else engine.kv_capacity_tokens
        if budget_limits is not None:
            budget_limits = dataclasses.replace(budget_limits, floor_tokens=floor)
        self.budget = BudgetTracker(floor, budget_limits)
        self._resident_since_generation: set[str] = set()
        # What a re-prefilled token costs on this engine, fitted from its timed iterations (the adaptive
        # budget's cost rule); the context's tokens when each generation started (its generated tokens).
        self._cost_meter = CostMeter()
        self._generation_started: dict[str, int] = {}
        self.admission = AdmissionLimits(max_resident_tasks=max_resident_tasks)
        self.staleness_allowance = staleness_allowance
        self.on_failure = on_failure
        self.report = WorkerReport(max_budget_tokens=self.budget_tokens)
        self._pending: OrderedDict[str, list[TaskSpec]] = OrderedDict()
        self._group_size: dict[str, int] = {}
        self._group_finished: dict[str, int] = {}
        self._probe_tokens: dict[str, int] = {}
        self._probing: set[str] = set()
        self._runs: dict[str, TaskRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._paused: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Event()
        self._failure: BaseException | None = None

    # ---- feeding ------------------------------------------------------------------------

    def add_groups(self, groups: Iterable[GroupSpec]) -> None:
        for group in groups:
            if group.group_id in self._group_size:
                raise ValueError(f"add_groups: group {group.group_id!r} was already added to this worker")
            self._pending[group.group_id] = list(group.tasks)
            self._group_size[group.group_id] = group.size
            self._group_finished[group.group_id] = 0
        self._changed.set()

    def poke(self) -> None:
        """Decide again now (e.g. a new weights version raised the staleness allowance)."""
        self._changed.set()

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    @property
    def num_resident(self) -> int:
        """Started tasks that are not paused (their KV is meant to stay on the engine)."""
        return len(self._runs) - len(self._paused)

    @property
    def num_generating(self) -> int:
        """Tasks waiting on the engine now (not on their environment, not paused)."""
        return sum(1 for run in self._runs.values() if run.phase is Phase.GENERATING)

    @property
    def num_unfinished(self) -> int:
        return sum(len(v) for v in self._pending.values()) + len(self._runs)

    # ---- the loop -----------------------------------------------------------------------

    async def run(self) -> WorkerReport:
        """Run until every added task has finished (more groups may be added meanwhile)."""
        started = time.monotonic()
        try:
            while self.num_unfinished:
                self._changed.clear()
                self._act(self._decide())
                await self._changed.wait()
                if self._failure is not None:
                    raise self._failure
        except BaseException:
            await self.abandon()  # no task keeps running behind a failed or cancelled worker
            raise
        finally:
            self.report.wall_s += time.monotonic() - started
        return self.report

    async def abandon(self, task_ids: Iterable[str] | None = None, *,
                      handoff: bool = False) -> list[tuple[TaskSpec, TaskProgress | None]]:
        """Stop these tasks (default: every task) and return the unfinished ones, to be played
        elsewhere (a rank leaving rollout at a sync boundary, or tasks that could no longer be
        trained within the staleness bound). Without `handoff` their env sessions end and they
        start again from scratch. With it, a task stopped at a turn boundary keeps its session
        (paused) and comes back with its progress, for another rank to carry on."""
        wanted = None if task_ids is None else set(task_ids)
        left: list[tuple[TaskSpec, TaskProgress | None]] = []
        for group_id, specs in list(self._pending.items()):
            for spec in [s for s in specs if wanted is None or s.task_id in wanted]:
                specs.remove(spec)
                left.append((spec, spec.progress if handoff else None))
            if not specs:
                del self._pending[group_id]
        stopping = {t: task for t, task in self._tasks.items() if wanted is None or t in wanted}
        runs = {t: self._runs[t] for t in stopping if t in self._runs}
        for run in runs.values():
            run.handoff = handoff
            # A probe stopped before its first turn was measured must not hold its group back.
            self._probing.discard(run.spec.group_id)
        for task in stopping.values():
            task.cancel()
        await asyncio.gather(*stopping.values(), return_exceptions=True)
        for task_id, run in runs.items():
            if run.phase is not Phase.FINISHED:  # one that finished meanwhile went to the sink
                movable = handoff and run.checkpoint is not None
                left.append((run.spec, progress_of(run, self.server_of(run)) if movable else None))
        for task_id in stopping:
            self._runs.pop(task_id, None)
            self._tasks.pop(task_id, None)
            self._paused.pop(task_id, None)
            self._resident_since_generation.discard(task_id)
        self._changed.set()
        return left

    def running(self) -> dict[str, TaskRun]:
        """The started, unfinished tasks by task id (a copy)."""
        return dict(self._runs)

    def server_of(self, run: TaskRun) -> str | None:
        """The env server URL of the task's session (None: an in-process env, or the session ended)."""
        server_of = getattr(self.env, "server_of", None)
        if server_of is None or run.session_id is None:
            return None
        try:
            return server_of(run.session_id)
        except KeyError:  # the session ended (the task stopped mid env step): nothing to hand over
            return None

    def _rank_view(self) -> RankView:
        tasks = []
        for task_id, run in self._runs.items():
            group_id = run.spec.group_id
            if task_id in self._paused:
                state = TaskState.PAUSED
            elif run.phase is Phase.GENERATING:
                state = TaskState.ACTIVE
            else:
                state = TaskState.WAITING_ENV
            if run.phase is Phase.STARTING:
                footprint = self._probe_estimate(group_id)
            else:
                footprint = self._blocks(run.context_tokens + self.limits.max_new_tokens)
            tasks.append(
                CtbTask(
                    task_id=task_id,
                    group_id=group_id,
                    state=state,
                    footprint_tokens=footprint,
                    context_tokens=run.context_tokens,
                    is_eval=run.spec.is_eval,
                    group_completion=self._group_finished[group_id] / self._group_size[group_id],
                    task_type=run.spec.task_type,
                )
            )
        return RankView(budget_tokens=self.budget_tokens, tasks=tuple(tasks))

    @property
    def budget_tokens(self) -> int:
        """CTB's KV token budget now (adaptive: as last adjusted)."""
        return self.budget.budget_tokens

    def _blocks(self, tokens: int) -> int:
        """Tokens rounded up to whole KV blocks (what a context really occupies), at most the
        whole budget: a task bigger than the rank still runs, alone, instead of never resuming."""
        block = self.engine.kv_block_tokens
        return min(-(-tokens // block) * block, self.budget_tokens)

    def _probe_estimate(self, group_id: str) -> int:
        if group_id in self._probe_tokens:
            return self._probe_tokens[group_id]
        known = list(self._probe_tokens.values())
        # An unprobed group's probe is admitted at the mean measured footprint; before any
        # measurement at the whole budget, so the very first probe runs alone.
        return sum(known) // len(known) if known else self.budget_tokens

    def _candidates(self) -> list[CandidateGroup]:
        out = []
        for group_id, specs in self._pending.items():
            if not specs:
                continue
            if self.scheduler.uses_probes and group_id not in self._probe_tokens:
                if group_id in self._probing:
                    continue  # the probe's first turn is not measured yet
                specs = specs[:1]
            out.append(
                CandidateGroup(
                    group_id=group_id,
                    task_ids=tuple(s.task_id for s in specs),
                    probed_footprint_tokens=self._probe_estimate(group_id),
                    is_eval=specs[0].is_eval,
                    task_type=specs[0].task_type,
                )
            )
        return out

    def _decide(self) -> CtbDecision:
        limits = self.admission
        if self.staleness_allowance is not None:
            limits = dataclasses.replace(limits, staleness_task_allowance=self.staleness_allowance())
        decision = self.scheduler.decide(self._rank_view(), self._candidates(), limits)
        self.budget.held_back(decision.budget_bound)
        return decision

    def _judge_turn(self, run: TaskRun) -> None:
        """Count the turn that just generated: did its context come back from the prefix cache? Only
        turns of tasks that stayed resident since their previous generation count (a paused task is
        expected to lose its cache). Adjusts an adaptive budget once a window is judged."""
        cached, run.cached_tokens = run.cached_tokens, None
        task_id = run.spec.task_id
        prompt_tokens = self._generation_started.pop(task_id, None)
        generated = max(0, run.context_tokens - prompt_tokens) if prompt_tokens is not None else 0
        for it in self.engine.take_iterations():
            self._cost_meter.observe(it.wall_s, it.prefill_tokens, it.decoding)
        resident = task_id in self._resident_since_generation
        self._resident_since_generation.add(task_id)
        if cached is None or not resident:
            return
        before = self.budget.budget_tokens
        kept = self.budget.judge(run.prefix_tokens, cached, self.engine.kv_block_tokens, generated,
                                 self._cost_meter.cost())
        if kept is None:
            return
        if kept:
            self.report.prefix_kept_turns += 1
        else:
            self.report.prefix_evicted_turns += 1
        if self.budget.budget_tokens != before:
            self.report.max_budget_tokens = max(self.report.max_budget_tokens, self.budget.budget_tokens)
            self._changed.set()

    def _act(self, decision: CtbDecision) -> None:
        for task_id in decision.pause:
            self._paused[task_id] = asyncio.Event()
            self.report.num_pauses += 1
        for task_id in decision.resume:
            self._paused.pop(task_id).set()
            self.report.num_resumes += 1
        admitted = set(decision.admit)
        for group_id, specs in list(self._pending.items()):
            for spec in [s for s in specs if s.task_id in admitted]:
                specs.remove(spec)
                if self.scheduler.uses_probes and group_id not in self._probe_tokens:
                    self._probing.add(group_id)
                self._start(spec)
            if not specs:
                del self._pending[group_id]
        resident = sum(1 for t in self._runs if t not in self._paused)
        self.report.max_resident_tasks = max(self.report.max_resident_tasks, resident)

    def _start(self, spec: TaskSpec) -> None:
        self.report.num_admitted += 1
        run = TaskRun(spec=spec)
        self._runs[spec.task_id] = run
        self._tasks[spec.task_id] = asyncio.create_task(self._play(spec, run), name=f"task {spec.task_id}")

    async def _play(self, spec: TaskSpec, run: TaskRun) -> None:
        try:
            trajectory = await run_task(spec, run, self.engine, self.env, self.fmt, self.limits, self)
            self._group_finished[spec.group_id] += 1
            self.report.num_tasks += 1
            self.report.num_generated_tokens += trajectory.num_generated_tokens
            self.report.reward_sum += trajectory.reward
            if self.sink is not None:
                result = self.sink(trajectory)
                if inspect.isawaitable(result):
                    await result
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self.on_failure is not None:
                self.on_failure(spec, e)
            else:  # surfaces in run(); a lost task must not pass silently
                self._failure = e
        except BaseException as e:
            self._failure = e
        finally:
            self._runs.pop(spec.task_id, None)
            self._tasks.pop(spec.task_id, None)
            self._paused.pop(spec.task_id, None)
            self._resident_since_generation.discard(spec.task_id)
            self._generation_started.pop(spec.task_id, None)
            if spec.group_id in self._probing and spec.group_id not in self._probe_tokens:
                # A probe that ended (failed) before its first turn was measured: the group's next task
                # probes instead; otherwise the group's other tasks would never be admitted.
                self._probing.discard(spec.group_id)
            self._changed.set()

    # ---- TurnGate -----------------------------------------------------------------------

    async def before_generate(self, run: TaskRun, env: EnvLink) -> None:
        group_id = run.spec.group_id
        if group_id in self._probing and group_id not in self._probe_tokens:
            self._probe_tokens[group_id] = self._blocks(run.context_tokens + self.limits.max_new_tokens)
            self._probing.discard(group_id)
            self._changed.set()
        while run.spec.task_id in self._paused:
            self._resident_since_generation.discard(run.spec.task_id)
            event = self._paused[run.spec.task_id]
            run.phase = Phase.PAUSED
            run.num_pauses += 1
            self._changed.set()
            assert run.session_id is not None
            await env.pause(run.session_id)
            await event.wait()
            await env.resume(run.session_id)
        run.phase = Phase.GENERATING
        self._generation_started[run.spec.task_id] = run.context_tokens
        self._changed.set()

    def after_turn(self, run: TaskRun) -> None:
        if run.cached_tokens is not None:
            self._judge_turn(run)
        self._changed.set()
