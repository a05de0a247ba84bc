"""User-facing errors. A UserError carries one line: what is wrong and how to fix it.

Anything raised as UserError is printed without a traceback (on rank 0 only, under MPI) and the
process exits with EXIT_USER_ERROR; every other exception is a bug and keeps its traceback.
"""

EXIT_USER_ERROR = 2
EXIT_RUNTIME_ERROR = 3
EXIT_INTERRUPTED = 4


class UserError(Exception):
    """Bad input (config, file, flag). The message names the problem and the fix."""


class CheckpointError(UserError):
    """A model file is missing, truncated, corrupt or of an unsupported kind."""


class PeerError(RuntimeError):
    """A peer rank stopped answering within the deadline (dead rank, network)."""


def one_line(message) -> str:
    """The error contract is one line; a message quoting file content may hold newlines."""
    return " ".join(str(message).splitlines())
