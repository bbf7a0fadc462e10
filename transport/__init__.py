"""trioserve.transport: the network gateway.

One port serves the Open Inference Protocol v2 REST API (KServe v2 / Triton: JSON and
binary tensors), a ``/v2/stream`` WebSocket for many requests in flight on one
connection, and Prometheus ``/metrics``. The data plane is an h11 server on trio;
the control plane a quart-trio app called in-process; streams are served over
wsproto by the gateway's own read loop (the client, ``open_stream``, uses
trio-websocket).
"""

from ._auth import Authenticator as Authenticator
from ._client import HttpClient as HttpClient
from ._client import HttpResponse as HttpResponse
from ._client import infer_body as infer_body
from ._client import open_http as open_http
from ._connections import GatewayStatistics as GatewayStatistics
from ._gateway import Gateway as Gateway
from ._gateway import open_gateway as open_gateway
from ._listeners import open_listeners as open_listeners
from ._main import bench_http_main as bench_http_main
from ._main import serve as serve
from ._main import serve_main as serve_main
from ._request import InferRequest as InferRequest
from ._response import encode_response as encode_response
from ._signature import ModelSignature as ModelSignature
from ._stream_client import StreamClient as StreamClient
from ._stream_client import StreamReply as StreamReply
from ._stream_client import open_stream as open_stream
