"""How a run is stopped, paused and killed on purpose: cancellation tokens, the collector pause, the crash harness's kill points.

Cross-cutting, like the top-level modules: any room may import it; it imports only storage.errors.
"""
