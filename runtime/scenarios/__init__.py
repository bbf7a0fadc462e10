"""Scenario benches: ``trioserve bench --scenario NAME``.

Each scenario lives in a module here with ``run(name, args) -> int`` (``args`` are
``trioserve bench``'s options, of which a scenario reads ``--duration`` and ``--json``;
the command refuses the others with a scenario, and ``-d`` for ``cache``); it prints
its figures and whether each target holds, writes them as JSON under
``bench-results/``, and returns 0 when every target holds, 1 otherwise. Modules are
imported only when their scenario runs.
"""

from __future__ import annotations

import argparse
import importlib

#: scenario name -> (module, one-line description)
SCENARIOS: dict[str, tuple[str, str]] = {
    "fair": ("trioserve.scenarios._sched", "A:B:C weights 1:1:2 backlogged on mlp"),
    "flood": ("trioserve.scenarios._sched", "A floods at 10x capacity, B steady at 20%"),
    "priority": ("trioserve.scenarios._sched", "realtime at 70% beside a batch backlog"),
    "long-inputs": ("trioserve.scenarios._sched", "minilm: A's texts 8x longer than B's"),
    "overload": ("trioserve.scenarios._sched", "5x capacity offered with 500 ms deadlines"),
    "faults": ("trioserve.scenarios._faults", "a 10 s straggler, killed workers, a raising model"),
    "autoscale": (
        "trioserve.scenarios._autoscale",
        "sleep device, 1-4 replicas: load steps low, high (3 replicas' worth), low",
    ),
    "rollout": (
        "trioserve.scenarios._rollout",
        "canary promoted, bad canary rolled back, shadow compared (CPU, ~20 s)",
    ),
    "cache-http": ("trioserve.scenarios._cache_http", "HTTP on mlp, Zipf keys, cache on vs off"),
    "gateway": ("trioserve.scenarios._gateway", "HTTP, batch dimension and WebSocket on mlp"),
    "cache": (
        "trioserve.scenarios._cache",
        "hit rates of W-TinyLFU, LRU and Belady on synthetic traces",
    ),
}


def run_scenario(name: str, args: argparse.Namespace) -> int:
    module, _ = SCENARIOS[name]
    return importlib.import_module(module).run(name, args)
