"""Planted bugs for ``python -m fuzz --self-test``: subclasses of the product's classes,
each breaking one promise. They exist only here; the product code is never changed.

The bugs live beside the classes they break: ``_mutants_queue.py`` (the queue and
the credits), ``_mutants_runtime.py`` (the batcher, the scheduler actor, the
breakers, the runtime), ``_mutants_cache.py`` and ``_mutants_flights.py`` (the
result cache and its flights), ``_mutants_rollout.py`` (the rollout) and
``_mutants_control.py`` (model control and autoscaling). :data:`MUTANTS`, the one
list the self-test walks, names each with the suites that can see it.
"""

from __future__ import annotations

import attrs

from ._mutants_cache import JoinsOlderFlights, OneNamespace, TtlIgnoredOnGet
from ._mutants_control import (
    HandOverDropsTheQueued,
    HandOverRefusesLateSubmits,
    StartingReplicasUncounted,
    UnloadsBeforeTheReplacedCopyDrained,
    UnloadWaitsForAReload,
    WindowOfTheLastSample,
)
from ._mutants_faults import (
    CutOffIgnoresUnreadResults,
    CutOffLeavesFollowersWaiting,
    DeathFailsTheBatch,
    FallbackWhileOpen,
    NeverReadCharged,
    SendingBatchBlamed,
    UnreadResultsRunAgain,
)
from ._mutants_flights import (
    CacheActorIgnoringLateOutcomes,
    CacheActorWithNoRerun,
    CacheActorWithRerunForTheLatest,
    CacheActorWithRerunForThePassed,
)
from ._mutants_queue import (
    AgedFirst,
    DeadlineWithdrawalAsCallers,
    DropsOneRequest,
    DropsRunningCopies,
    ExceedsBudget,
    FailedBatchesStayInService,
    GrantsOnAnyCredit,
    IgnoresDeadlines,
    IgnoresWeights,
    NoAging,
    PushOutsOnlyShed,
    QueuesCallsItemByItem,
    RefundsToTheLevel,
    ReversesBatches,
)
from ._mutants_rollout import (
    PauseHoldsTheChecks,
    PauseStillAdvancesSteps,
    PromotesARolledBackCanary,
    ResumeCountsThePause,
    ResumesAfterARollback,
    ResumeWaitsForAnAnswer,
    RoutesByThePreviousShare,
    ShadowQueuePastItsBound,
    StartKeepsTheOldStable,
)
from ._mutants_runtime import (
    AnswersExpiredRequestsLate,
    ConfirmsAcrossRuns,
    DropsPartsForElsewhere,
    KeepsAnsweredTwins,
    KeepsApartWhereTheyRaised,
    RetriesWhereTheyRaised,
    RunsCopiesBesideOriginals,
    SubmitsSplitCallsItemByItem,
    SwapsTwoReplies,
    _ExpiresTheWholeBatch,
    _in_flight_of,
    _NeverDisarms,
)
from ._product import PRODUCT, Product

#: name -> (what it breaks, the broken product, the suites that can see it, in the
#: order the self-test tries them: the one that catches it soonest first)
MUTANTS: dict[str, tuple[str, Product, tuple[str, ...]]] = {
    "drop-request": (
        "next_batch drops one request of a batch",
        attrs.evolve(PRODUCT, name="drop-request", queue_class=DropsOneRequest),
        ("queue", "runtime"),
    ),
    "swap-replies": (
        "the batcher answers two requests with each other's output",
        attrs.evolve(PRODUCT, name="swap-replies", batcher_class=SwapsTwoReplies),
        ("runtime",),
    ),
    "dispatch-expired": (
        "the queue skips the deadline check (a request's and a call's items')",
        attrs.evolve(PRODUCT, name="dispatch-expired", queue_class=IgnoresDeadlines),
        ("queue", "runtime"),
    ),
    "over-budget": (
        "batches close at max_batch_size + 1 (and max_batch_tokens + 1)",
        attrs.evolve(PRODUCT, name="over-budget", queue_class=ExceedsBudget),
        ("queue", "runtime"),
    ),
    "no-aging": (
        "aging is disabled",
        attrs.evolve(PRODUCT, name="no-aging", queue_class=NoAging),
        ("queue", "runtime"),
    ),
    "aged-first": (
        "aged requests go before everything else: a backlog of them starves the top class",
        attrs.evolve(PRODUCT, name="aged-first", queue_class=AgedFirst),
        ("queue", "runtime"),
    ),
    # Beyond the five of the issue: the FIFO and fair-share checks need teeth too.
    "reversed-batch": (
        "a batch is handed out newest first (FIFO within a flow broken)",
        attrs.evolve(PRODUCT, name="reversed-batch", queue_class=ReversesBatches),
        ("queue", "runtime"),
    ),
    "ignore-weights": (
        "fair share ignores the tenants' weights",
        attrs.evolve(PRODUCT, name="ignore-weights", queue_class=IgnoresWeights),
        ("queue", "runtime"),
    ),
    "push-out-for-refused-call": (
        "a call's items are queued one by one: those before a refused item push out "
        "other tenants' requests for a call then refused whole",
        attrs.evolve(PRODUCT, name="push-out-for-refused-call", queue_class=QueuesCallsItemByItem),
        ("queue",),
    ),
    "split-call-item-by-item": (
        "a call split between a model's lanes is queued item by item: an item queued "
        "in one lane pushes out others for a call the other lane then refuses",
        attrs.evolve(
            PRODUCT, name="split-call-item-by-item", runtime_class=SubmitsSplitCallsItemByItem
        ),
        ("runtime",),
    ),
    # The queue suite's own: hedge copies, withdrawal at a caller's deadline, failed
    # batches.
    "copy-dropped-while-running": (
        "a new request takes the room of a hedge copy already dispatched: the copy is "
        "answered twice",
        attrs.evolve(PRODUCT, name="copy-dropped-while-running", queue_class=DropsRunningCopies),
        ("queue",),
    ),
    "deadline-withdrawal-uncounted": (
        "a request withdrawn at its caller's deadline counts as withdrawn by its caller, "
        "not expired",
        attrs.evolve(
            PRODUCT, name="deadline-withdrawal-uncounted", queue_class=DeadlineWithdrawalAsCallers
        ),
        ("queue",),
    ),
    "failed-batch-in-service": (
        "a failed batch's cost stays counted in service",
        attrs.evolve(
            PRODUCT, name="failed-batch-in-service", queue_class=FailedBatchesStayInService
        ),
        ("queue",),
    ),
    "push-out-uncounted": (
        "a request pushed out of a full queue counts in shed only, not in pushed_out",
        attrs.evolve(PRODUCT, name="push-out-uncounted", queue_class=PushOutsOnlyShed),
        ("queue",),
    ),
    # The runtime suite's own: hedges on several replicas, parts run elsewhere after
    # they raised alone on a replica, and the breakers' evidence.
    "twin-not-withdrawn": (
        "a replica that answers one of a hedged request's two copies leaves the other "
        "queued or running",
        attrs.evolve(PRODUCT, name="twin-not-withdrawn", batcher_class=KeepsAnsweredTwins),
        ("runtime",),
    ),
    "copy-beside-original": (
        "a batcher runs a hedge copy in one batch with its original",
        attrs.evolve(
            PRODUCT, name="copy-beside-original", batcher_class=RunsCopiesBesideOriginals
        ),
        ("runtime",),
    ),
    "elsewhere-dropped": (
        "a part marked to run on another replica is never handed back",
        attrs.evolve(PRODUCT, name="elsewhere-dropped", batcher_class=DropsPartsForElsewhere),
        ("runtime",),
    ),
    "elsewhere-same-replica": (
        "a part marked to run on another replica is taken by the replica it raised on",
        attrs.evolve(
            PRODUCT, name="elsewhere-same-replica", scheduler_class=RetriesWhereTheyRaised
        ),
        ("runtime",),
    ),
    "apart-same-replica": (
        "a part kept apart from its hedge twin's replica is taken by the replica it "
        "raised alone on",
        attrs.evolve(
            PRODUCT, name="apart-same-replica", scheduler_class=KeepsApartWhereTheyRaised
        ),
        ("runtime",),
    ),
    "confirmed-across-runs": (
        "a part answered elsewhere counts against its replica after that replica "
        "succeeded, or while its breaker is open",
        attrs.evolve(PRODUCT, name="confirmed-across-runs", breaker_class=ConfirmsAcrossRuns),
        ("runtime",),
    ),
    # The runtime suite's running batches (Scenario.running): the runtime's deadlines
    # of requests whose batch runs on a worker.
    "late-answer-unguarded": (
        "a running batch's late answer goes to a request already answered "
        "DeadlineExceeded too",
        attrs.evolve(
            PRODUCT, name="late-answer-unguarded", batcher_class=AnswersExpiredRequestsLate
        ),
        ("runtime",),
    ),
    "expiry-not-disarmed": (
        "a batch's deadlines stay armed with the watchdog after it leaves its replica",
        attrs.evolve(
            PRODUCT, name="expiry-not-disarmed", batcher_class=_in_flight_of(_NeverDisarms)
        ),
        ("runtime",),
    ),
    "expiry-whole-batch": (
        "at a running batch's first deadline, all its requests still waiting are "
        "answered DeadlineExceeded",
        attrs.evolve(
            PRODUCT, name="expiry-whole-batch",
            batcher_class=_in_flight_of(_ExpiresTheWholeBatch),
        ),
        ("runtime",),
    ),
    # A worker's death on a running scenario's replica, after it wrote results
    # nobody read, or while a batch was sent to it, and a worker cut off as it wrote
    # the late batch's result, the batch after it never read (fuzz/_mutants_faults.py).
    "unread-results-run-again": (
        "the results a dead worker wrote and nobody read are dropped: their batches "
        "run again",
        attrs.evolve(
            PRODUCT, name="unread-results-run-again", batcher_class=UnreadResultsRunAgain
        ),
        ("runtime",),
    ),
    "sending-batch-blamed": (
        "a batch whose sending its worker died in is split as the suspect of the death",
        attrs.evolve(PRODUCT, name="sending-batch-blamed", batcher_class=SendingBatchBlamed),
        ("runtime",),
    ),
    "cut-off-ignores-unread": (
        "a worker cut off as a straggler is not asked for the result it wrote as the "
        "deadline passed: the late batch runs again as the suspect",
        attrs.evolve(
            PRODUCT, name="cut-off-ignores-unread", batcher_class=CutOffIgnoresUnreadResults
        ),
        ("runtime",),
    ),
    "never-read-charged": (
        "a batch its lost worker never read whole (its pipe said so) is charged as "
        "begun: the suspect of a death after a written result, or run behind a "
        "straggler cut off as it wrote",
        attrs.evolve(PRODUCT, name="never-read-charged", batcher_class=NeverReadCharged),
        ("runtime",),
    ),
    # The admission suite's own: the credits.
    "refund-to-level": (
        "a refund goes back to the level whatever waits behind it",
        attrs.evolve(PRODUCT, name="refund-to-level", bucket_class=RefundsToTheLevel),
        ("admission",),
    ),
    "overdraw": (
        "try_take grants whenever the level is positive",
        attrs.evolve(PRODUCT, name="overdraw", bucket_class=GrantsOnAnyCredit),
        ("admission",),
    ),
    # The cache suite's own.
    "flight-without-generation": (
        "a flight's key leaves out the generation: a caller after an invalidation joins "
        "an older flight",
        attrs.evolve(
            PRODUCT, name="flight-without-generation", cache_actor_class=JoinsOlderFlights
        ),
        ("cache",),
    ),
    "one-namespace": (
        "the cache key's namespace ignores the tenant",
        attrs.evolve(PRODUCT, name="one-namespace", cache_class=OneNamespace),
        ("cache",),
    ),
    "ttl-ignored-on-get": (
        "a lookup ignores the entry's expiry",
        attrs.evolve(PRODUCT, name="ttl-ignored-on-get", cache_class=TtlIgnoredOnGet),
        ("cache",),
    ),
    # A flight and its callers' deadlines (fuzz/_mutants_flights.py).
    "flight-no-rerun": (
        "a flight answers every waiter with its driver's deadline error (no rerun)",
        attrs.evolve(
            PRODUCT, name="flight-no-rerun", cache_actor_class=CacheActorWithNoRerun
        ),
        ("cache",),
    ),
    "rerun-for-latest": (
        "a flight's rerun is driven by the waiter with the latest deadline, not the "
        "earliest",
        attrs.evolve(
            PRODUCT, name="rerun-for-latest",
            cache_actor_class=CacheActorWithRerunForTheLatest,
        ),
        ("cache",),
    ),
    "rerun-for-passed": (
        "a flight reruns for waiters whose own deadline has passed too",
        attrs.evolve(
            PRODUCT, name="rerun-for-passed",
            cache_actor_class=CacheActorWithRerunForThePassed,
        ),
        ("cache",),
    ),
    "late-outcome-ignored": (
        "a flight whose driver's deadline passed while its batch ran runs again at once "
        "instead of waiting for that batch's answer",
        attrs.evolve(
            PRODUCT, name="late-outcome-ignored",
            cache_actor_class=CacheActorIgnoringLateOutcomes,
        ),
        ("cache",),
    ),
    # The faults a model off the event loop meets behind the cache
    # (fuzz/_mutants_faults.py).
    "cut-off-followers-waiting": (
        "a batch cut off neither carries nor settles the late outcome its flight's "
        "waiters wait for",
        attrs.evolve(
            PRODUCT, name="cut-off-followers-waiting",
            batcher_class=CutOffLeavesFollowersWaiting,
        ),
        ("cache",),
    ),
    "death-fails-the-batch": (
        "a batch whose worker died is answered with the death's error, not retried",
        attrs.evolve(PRODUCT, name="death-fails-the-batch", batcher_class=DeathFailsTheBatch),
        ("cache",),
    ),
    "fallback-while-open": (
        "a replica whose breaker is open answers what it pulls with an empty fallback, "
        "which the cache keeps",
        attrs.evolve(PRODUCT, name="fallback-while-open", batcher_class=FallbackWhileOpen),
        ("cache",),
    ),
    # The rollout suite's own.
    "split-previous-share": (
        "the split counts a new step's requests by the previous step's share",
        attrs.evolve(PRODUCT, name="split-previous-share", rollout_class=RoutesByThePreviousShare),
        ("rollout",),
    ),
    "rollback-not-final": (
        "a rolled-back canary goes back on trial at the next tick",
        attrs.evolve(PRODUCT, name="rollback-not-final", rollout_class=ResumesAfterARollback),
        ("rollout",),
    ),
    "pause-advances-steps": (
        "a paused canary's step still ends on time (the last promotes it)",
        attrs.evolve(PRODUCT, name="pause-advances-steps", rollout_class=PauseStillAdvancesSteps),
        ("rollout",),
    ),
    "resume-counts-pause": (
        "a resume counts the pause in the step's step_s",
        attrs.evolve(PRODUCT, name="resume-counts-pause", rollout_class=ResumeCountsThePause),
        ("rollout",),
    ),
    "promote-after-rollback": (
        "the operator may promote a rolled-back canary",
        attrs.evolve(
            PRODUCT, name="promote-after-rollback", rollout_class=PromotesARolledBackCanary
        ),
        ("rollout",),
    ),
    "start-keeps-old-stable": (
        "a trial started after a promotion runs against the old stable, not the promoted "
        "canary",
        attrs.evolve(PRODUCT, name="start-keeps-old-stable", rollout_class=StartKeepsTheOldStable),
        ("rollout",),
    ),
    "pause-holds-checks": (
        "a paused canary's outcomes are counted but not checked (no rollback while paused)",
        attrs.evolve(PRODUCT, name="pause-holds-checks", rollout_class=PauseHoldsTheChecks),
        ("rollout",),
    ),
    "resume-not-at-once": (
        "a step due at a resume ends only at the canary's next answer",
        attrs.evolve(
            PRODUCT, name="resume-not-at-once", rollout_controller_class=ResumeWaitsForAnAnswer
        ),
        ("rollout",),
    ),
    "shadow-past-its-bound": (
        "the shadow's channel holds two copies more than shadow_queue",
        attrs.evolve(
            PRODUCT, name="shadow-past-its-bound", rollout_controller_class=ShadowQueuePastItsBound
        ),
        ("rollout",),
    ),
    # The control suite's own.
    "unload-before-drained": (
        "an unload returns before a copy an earlier reload replaced has drained",
        attrs.evolve(
            PRODUCT, name="unload-before-drained",
            control_class=UnloadsBeforeTheReplacedCopyDrained,
        ),
        ("control",),
    ),
    "unload-waits-for-reload": (
        "an unload waits for a reload under way instead of abandoning it",
        attrs.evolve(
            PRODUCT, name="unload-waits-for-reload", control_class=UnloadWaitsForAReload,
        ),
        ("control",),
    ),
    "hand-over-drops-queued": (
        "a hand-over drops the batch queued at the swap",
        attrs.evolve(
            PRODUCT, name="hand-over-drops-queued", scheduler_class=HandOverDropsTheQueued
        ),
        ("control",),
    ),
    "hand-over-refuses-late": (
        "a queue handed over refuses a request submitted after the swap (ActorClosed)",
        attrs.evolve(
            PRODUCT, name="hand-over-refuses-late", scheduler_class=HandOverRefusesLateSubmits
        ),
        ("control",),
    ),
    # The autoscale suite's own.
    "starts-uncounted": (
        "replicas still loading are not counted: concurrent starts overshoot max_replicas",
        attrs.evolve(
            PRODUCT, name="starts-uncounted", scaling_controller_class=StartingReplicasUncounted
        ),
        ("autoscale",),
    ),
    "window-last-sample": (
        "the look-back window's mean is its latest sample alone",
        attrs.evolve(PRODUCT, name="window-last-sample", autoscaler_class=WindowOfTheLastSample),
        ("autoscale",),
    ),
}
