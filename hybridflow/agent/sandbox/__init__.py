"""Run untrusted code (a model's tool call, a code answer being graded) in a locked-down process.

``core.py`` runs it (namespaces, the view of the file system, limits, output); ``cgroup.py`` makes
the limits hold for the whole sandbox; ``seccomp.py`` is the system-call filter; ``init.py`` is the
program that runs as the sandbox's init; ``bridge.py`` carries a sandboxed black-box agent's HTTP
to the run's endpoint (a Unix socket bound in). The threat model is in docs/agents.md.
"""

from hybridflow.agent.sandbox.core import (
    LIMIT_FIELDS,
    Enforcement,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    default_sandbox,
    run_python,
)

__all__ = ["LIMIT_FIELDS", "Enforcement", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "default_sandbox", "run_python"]
