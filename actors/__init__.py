"""trioserve.actors: scheduler, batcher, metrics, and the sans-IO decisions they call."""

from ._batcher import BatcherActor as BatcherActor
from ._batching import BatchBuilder as BatchBuilder
from ._batching import BatchLimits as BatchLimits
from ._batching import FifoQueue as FifoQueue
from ._batching import SchedulingPolicy as SchedulingPolicy
from ._fair import AimdLimit as AimdLimit
from ._fair import ClassSpec as ClassSpec
from ._fair import FairQueue as FairQueue
from ._fair import FlowStats as FlowStats
from ._fair import TokenBucket as TokenBucket
from ._metrics import Latency as Latency
from ._metrics import LatencySummary as LatencySummary
from ._metrics import ModelMetrics as ModelMetrics
from ._scheduler import SchedulerActor as SchedulerActor
