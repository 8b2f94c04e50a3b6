"""The client library for a running dynamod daemon: `Client(state_dir)` asks its control
socket (status, down, restart, policy push and publish). It sits below everything that
talks to a daemon (the CLI, chaos runs, the verl backend, the trainer) and imports only
dynamod.core, so none of them has to import the control layer to reach the daemon.
`UnitStatus` is the shape of one unit's row in its `status()["units"]`."""

from dynamod.client.control import Client
from dynamod.core.status import UnitStatus

__all__ = ["Client", "UnitStatus"]
