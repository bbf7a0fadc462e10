"""trioserve: a multi-tenant ML inference serving runtime on trio.

The kernel (errors, messages, config, actors, models) comes first; the assembly
(``open_runtime``, ``serve_in_thread``) wires ``trioserve.actors`` together.
"""

from . import _early_signals

if _early_signals.is_the_command():
    # Before the imports below (half a second): a stop signal meanwhile is noted, and
    # the command stops cleanly once it can (see _early_signals).
    _early_signals.hold()

from ._actor import Actor as Actor
from ._actor import ActorState as ActorState
from ._actor import RestartPolicy as RestartPolicy
from ._actor import supervise as supervise
from ._config import AutoscalingConfig as AutoscalingConfig
from ._config import CacheConfig as CacheConfig
from ._config import ClassConfig as ClassConfig
from ._config import Config as Config
from ._config import ModelConfig as ModelConfig
from ._config import RuntimeLimits as RuntimeLimits
from ._config import ServerConfig as ServerConfig
from ._config import TenantConfig as TenantConfig
from ._config_file import config_from_mapping as config_from_mapping
from ._config_file import load_config as load_config
from ._errors import ActorBroken as ActorBroken
from ._errors import ActorClosed as ActorClosed
from ._errors import ConfigError as ConfigError
from ._errors import DeadlineExceeded as DeadlineExceeded
from ._errors import Forbidden as Forbidden
from ._errors import InvalidInput as InvalidInput
from ._errors import ModelError as ModelError
from ._errors import ModelLoadError as ModelLoadError
from ._errors import Overloaded as Overloaded
from ._errors import QuotaExceeded as QuotaExceeded
from ._errors import TrioserveError as TrioserveError
from ._errors import Unauthorized as Unauthorized
from ._errors import UnknownModel as UnknownModel
from ._errors import exception_text as exception_text
from ._front import Runtime as Runtime
from ._messages import Reply as Reply
from ._messages import ReplyRelay as ReplyRelay
from ._messages import Request as Request
from ._messages import RequestState as RequestState
from ._model import V2_DTYPES as V2_DTYPES
from ._model import CallableBackend as CallableBackend
from ._model import ModelBackend as ModelBackend
from ._model import TensorSpec as TensorSpec
from ._model import TorchBackend as TorchBackend
from ._model import check_outputs as check_outputs
from ._model import device_lost as device_lost
from ._model import load_runner as load_runner
from ._process import WorkerProcess as WorkerProcess
from ._ray import RayReplica as RayReplica
from ._ray_config import RayConfig as RayConfig
from ._ray_config import RayReplicaConfig as RayReplicaConfig

# The assembly: imports trioserve.actors, which imports the names above.
from ._runtime import open_runtime as open_runtime
from ._thread import Client as Client
from ._thread import serve_in_thread as serve_in_thread
from ._triton_config import triton_platform as triton_platform
from ._versions_config import RolloutConfig as RolloutConfig
from ._versions_config import VersionConfig as VersionConfig

__version__ = "0.1.0"
