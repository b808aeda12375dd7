"""`ers:` section: Elastic Resource Scaling between rollout and trainer roles.

The planner itself is the pure module :mod:`tiderl.policy.ers`;
:meth:`tiderl.policy.ers.ErsLimits.from_config` turns this section plus the
trainer's elastic batch bounds into its limits.
"""

from __future__ import annotations

from typing import Literal

from tiderl.config.schema import option, section


@section
class ErsConfig:
    enabled: bool = option(True, help="Move ranks between rollout and trainer roles at sync boundaries.")
    policy: Literal["paper", "rate"] = option(
        "rate",
        help="`rate`: move toward the split where the measured generation rate meets the trainer's consumption "
        "rate (tiderl.policy.ers.choose); `paper`: the paper's threshold rules on HoL latency, RAS and the "
        "generation deficit (section 5.2). Cold start and evaluation rules apply to both.",
    )
    rate_margin: float = option(
        0.05,
        ge=0,
        help="Rate policy: move ranks only when the predicted goodput gain exceeds this share (hysteresis "
        "against noise).",
    )
    hol_tau: float = option(
        1.0, gt=0, help="Consumption deficit when the oldest ready micro-batch waited > tau x mean step time."
    )
    max_moves_per_step: int = option(
        1,
        ge=0,
        help="Most ranks that change role at one sync boundary (preemptive maximum rollout at cold "
        "start and evaluation is exempt: it only adds rollout capacity; so is the rate planner's trainer "
        "re-partition between actor and ref: it keeps the rollout side and regroups the actors once; and, with the "
        "rate policy, rollout ranks that the window measured idle leave rollout together).",
    )
    max_rollout_moves_per_step: int | None = option(
        None,
        ge=1,
        help="Most ranks that move to rollout (from ref, actor or idle) at one sync boundary, counted apart "
        "from `max_moves_per_step`, which then bounds only the moves that scale the trainer up (and to idle). "
        "null: the same bound for every move. The paper bounds only the trainer's scale-up to one rank a step; "
        "a rank given back to rollout costs no weight transfer (it joins the broadcast).",
    )
    min_rollout_ranks: int = option(1, ge=1, help="Fewest rollout ranks ERS keeps.")
    min_actor_ranks: int = option(1, ge=1, help="Fewest actor ranks ERS keeps.")
    elastic_actors: bool = option(
        False,
        help="Let ERS also move data-parallel actor ranks to and from rollout, and (`policy: rate`) divide "
        "the trainer's ranks anew between actor and ref where the RA2P cost model says so (the actor group "
        "is rebuilt at that boundary and a joining actor takes the weights and optimizer state of a current "
        "one); false: only dedicated ref ranks move and the actor group is fixed.",
    )
    max_ref_ranks: int | None = option(
        None, ge=0, help="Most dedicated ref ranks ERS provisions for the decoupled RA2P mode. null: no limit."
    )
    preemptive_rollout: bool = option(
        True, help="At cold start and before evaluation steps, move every ref (and idle) rank to rollout at "
        "once; when the evaluation is over, put those ranks back to the roles they held before it, at once."
    )
    evaluation_actors: bool = option(
        True, help="With `elastic_actors` and `preemptive_rollout`: an evaluation step may also take actor ranks "
        "to rollout, as many as the evaluation model predicts to shorten it by more than `rate_margin` (from "
        "the evaluation steps measured; before the first, from the rate window and the round's size; at a cold "
        "start that plays version 0's round, from the first map taken as balanced and the round's size); "
        "they return when the evaluation is over (not on a shared host). false: only ref and idle ranks go.",
    )
    adaptive_retention: bool = option(
        True,
        help="After a rollout scale-down that leaves a generation deficit, fetch fewer groups per step "
        "(halfway toward trainer.groups_min) so a reservoir of ready data remains.",
    )
    adaptive_admission: bool = option(
        False,
        help="Fewer training groups in flight than the staleness bound allows while the trainer drops "
        "groups as too stale (stragglers that finished after the last step that could train them) on busy "
        "engines, more again while it waits for data: an eighth of a batch a step, between one batch and "
        "(staleness + 1) batches, judged on the last three steps without an evaluation "
        "(tiderl.policy.admission). A resumed run starts again from the staleness bound. Off by default: "
        "in the simulator it costs up to 2% of goodput (docs/RESULTS.md, 2026-12-04).",
    )
    host_slots: float | None = option(
        None,
        gt=0,
        help="The ranks share one host's compute (a CPU-only run): how many busy trainer ranks the host runs "
        "at full speed at once (tools/calibrate_cpu.py measures it: `host_compute_slots`). The rate planner then "
        "predicts how a further busy rank slows the others, and may leave a rollout rank idle (its engine "
        "kept, claiming nothing). null: every rank has an accelerator of its own.",
    )
    idle_engines: Literal["on_demand", "parked"] = option(
        "on_demand",
        help="With `host_slots`: when an idle rank starts its rollout engine. `on_demand`: only once a plan "
        "wants the rank in rollout; it stays idle while the engine starts (minutes of the shared cores) and "
        "joins rollout at a later boundary. `parked`: at once, while idle, so that a move to rollout costs "
        "a weight reload, and the start takes the host's cores from the working ranks whether or not ERS "
        "ever moves the rank. Without `host_slots` every idle rank starts its engine while parked (its own "
        "accelerator: the start costs the others nothing).",
    )
    rollout_host_weight: float = option(
        1.0,
        gt=0,
        help="With `host_slots`: a busy rollout rank's demand on the host against a busy trainer rank's 1 "
        "(tools/calibrate_cpu.py: `rollout_busy_cores`).",
    )
    decoupled_step_s: float = option(
        0.0,
        ge=0,
        help="A decoupled step's coordination with its ref ranks beyond their work (the step's input to them, "
        "their log-probs back), once a step, s: the rate planner prices a split with ref ranks this much longer "
        "a step than one without. Measured on a CPU host with 2 cores: 0.13 (docs/RESULTS.md). 0: not priced.",
    )
    history_steps: int = option(5, ge=1, help="Recent steps: their mean duration is T_step for the HoL test, and at most this many settled "
                    "steps make the rate planner's window (it remembers the latency of earlier splits for 10x this).")
