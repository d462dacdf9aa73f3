"""``smetric engine``: a GPU-free stand-in for vLLM, to test and demo the router against.

Its timing and prefix cache are the simulator's (``model.perf``,
``model.kv``, ``core.prefix_cache``), so the mock and the simulator tell the same story.
"""

from smetric.engine.scheduler import EngineConfig, MockEngine
from smetric.engine.server import KVEventPublisher, create_app, run_engine

__all__ = ["EngineConfig", "KVEventPublisher", "MockEngine", "create_app", "run_engine"]
