"""A stand-in for Prefect's event subscriber, in the shapes the node agent uses it (``deployments/agent_events.py``).

The agent constructs ``prefect.events.clients.PrefectEventSubscriber(api_url=..., filter=...,
reconnect_on_clean_close=True)``, enters it with ``async with`` and receives with ``__aiter__`` and
``__anext__``. A test patches an instance of a subclass in for that class (``install``): each construction
is checked against the real subscriber's signature and recorded in ``subscriptions``; the subclass's
``__anext__`` brings the events.
"""

from __future__ import annotations

import inspect
from typing import Any, Self

import prefect.events.clients
from prefect.events.clients import PrefectEventSubscriber

_REAL = inspect.signature(PrefectEventSubscriber)  # taken before any test patches the name

class SubscriberStandIn:
    """Stands in for ``PrefectEventSubscriber``: calling it is constructing a subscription (self); entering it
    and iterating it return self, as the real one's ``__aenter__`` and ``__aiter__`` do."""

    def __init__(self) -> None:
        self.subscriptions: list[dict[str, Any]] = []  # each construction's keyword arguments, in order

    def install(self, monkeypatch) -> Self:
        """Patch this stand-in in for Prefect's subscriber for the test."""
        monkeypatch.setattr(prefect.events.clients, "PrefectEventSubscriber", self)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Self:
        # a TypeError here is the one the real subscriber raises for arguments it does not take
        _REAL.bind(*args, **kwargs)
        self.subscriptions.append(kwargs)
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb) -> None:
        return None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        raise NotImplementedError("a stand-in brings its own events")
