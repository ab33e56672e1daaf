"""A node agent killed with -9 in the middle of a refit, never to come back: the server closes its run.

The long harness (``python -m pytest -m long``; the default suite deselects
it): Prefect's zombie detection waits a window (``ZOMBIE_AFTER_S``, 45 s here;
the agent takes at least 30 s) after a run's last flow-run heartbeat (sent
every 30 s at least), so this scenario cannot be made shorter. The default
suite's fleet test (test_fleet.py) kills an agent the same way, checks that the
server holds the automation that would close the run, and restarts the agent
on the same host, which closes the run at once.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tests.support.fleet_support import (  # noqa: F401 - fleet_server is a fixture
    HELD_BUCKET, ZOMBIE_AFTER_S, Fleet, assert_zombie_automation, fleet_server, held_mid_refit,
)
from tests.support.s3_support import s3  # noqa: F401  (s3 is a fixture)
from testbed.processes import wait_until
from testbed.s3proxy import Faults

pytestmark = pytest.mark.server


@pytest.mark.long
def test_the_server_crashes_the_run_of_an_agent_that_never_comes_back(fleet_server, s3, tmp_path):
    """Killed in the middle of a refit, the agent's run is Crashed by the server (no heartbeat); the node,
    started again, recovers its store and catches up."""
    fleet = Fleet(fleet_server, s3.endpoint, tmp_path, f"{s3.prefix('zombie')}/catalog")
    with s3.proxy(Faults(), lifetime_s=600) as proxy:
        node = fleet.node("zombie", endpoint=proxy.url)
        try:
            node.start()
            fleet.registered(node)
            assert fleet.publish("initial")["version"] == "r0"
            assert fleet.final_runs("zombie", "r0")[0].state_name == "Ready"
            proxy.faults.get_latency_s, proxy.faults.latency_suffix = 600.0, HELD_BUCKET
            assert fleet.publish("delta", "--bucket-mib", "1")["version"] == "r1"
            interrupted = held_mid_refit(fleet, node, proxy, "r1")
            node.kill()
            proxy.faults.get_latency_s = 0.0
            assert_zombie_automation(fleet)
            orphan = wait_until("the server to mark the orphaned run Crashed", lambda: next(
                (r for r in fleet.runs("zombie", ("on_publish",)) if r.id == interrupted.id
                 and r.state_type.value == "CRASHED"), None), ZOMBIE_AFTER_S + 60, every_s=1.0,
                diagnostics=fleet.diagnostics)
            assert "no heartbeat" in orphan.state.message, orphan.state
            assert node.active_version() == "r0" and node.store().state().status == "UPDATING"
            restarted = datetime.now(timezone.utc)
            node.start()
            (caught_up,) = fleet.final_runs("zombie", "latest", which=("latest",), since=restarted)
            assert caught_up.state_name == "Ready" and caught_up.state.message.startswith("r1 ")
            assert node.active_version() == "r1" and node.store().state().status == "READY"
        finally:
            fleet.stop_all()
