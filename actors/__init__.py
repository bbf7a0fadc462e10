"""trioserve.actors: scheduler, batcher, metrics, the result cache, and the sans-IO
decisions they call."""

from ._batcher import BatcherActor as BatcherActor
from ._batching import BatchBuilder as BatchBuilder
from ._batching import BatchLimits as BatchLimits
from ._batching import FifoQueue as FifoQueue
from ._batching import SchedulingPolicy as SchedulingPolicy
from ._cache import CACHE_POLICIES as CACHE_POLICIES
from ._cache import RAW_INLINE as RAW_INLINE
from ._cache import Cache as Cache
from ._cache import CacheRule as CacheRule
from ._cache import CacheStatistics as CacheStatistics
from ._cache import LruPolicy as LruPolicy
from ._cache import WTinyLFU as WTinyLFU
from ._cache_actor import CacheActor as CacheActor
from ._cachekey import SHARED_NAMESPACE as SHARED_NAMESPACE
from ._cachekey import CacheKey as CacheKey
from ._cachekey import cache_key as cache_key
from ._cachekey import namespace_for as namespace_for
from ._fair import AimdLimit as AimdLimit
from ._fair import ClassSpec as ClassSpec
from ._fair import FairQueue as FairQueue
from ._fair import FlowStats as FlowStats
from ._fair import TokenBucket as TokenBucket
from ._metrics import Latency as Latency
from ._metrics import LatencySummary as LatencySummary
from ._metrics import ModelMetrics as ModelMetrics
from ._scheduler import SchedulerActor as SchedulerActor
from ._singleflight import SingleFlight as SingleFlight
from ._singleflight import SingleFlightStatistics as SingleFlightStatistics
from ._sketch import CountMinSketch as CountMinSketch
from ._straggler import BatchTimer as BatchTimer
from ._straggler import Breaker as Breaker
from ._straggler import RecentQuantile as RecentQuantile
from ._straggler import StragglerPolicy as StragglerPolicy
from ._straggler import split_failed as split_failed
from ._watchdog import Watchdog as Watchdog
