"""gRPC without its fork handlers in dynamod's own process: imported before any other module
of the package imports grpc. dynamod forks every unit from a process whose gRPC threads run
(this client), and its children exec at once, so gRPC's fork support (on by default in
grpcio 1.85: "Other threads are currently calling into gRPC, skipping fork() handlers" on
each spawn) has nothing to protect; with the handlers on, CI saw a unit killed by SIGSEGV
before it printed anything. gRPC reads the setting when it is imported, so the variable is
set for the import only and the environment the units inherit is left as it was."""

from __future__ import annotations

import os

_VAR = "GRPC_ENABLE_FORK_SUPPORT"
_given = os.environ.get(_VAR)
if _given is None:
    os.environ[_VAR] = "false"
try:
    import grpc  # noqa: F401  (the import that reads the variable)
finally:
    if _given is None:
        os.environ.pop(_VAR, None)
