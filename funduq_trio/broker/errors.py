"""The broker's exceptions: each names what a caller did wrong or what state
stopped the request, so a door can map it to its protocol's error."""


class FunduqError(Exception):
    """Base of every error the facade raises on purpose."""


class AgentNotFound(FunduqError):
    """No provider ever published this agent under this key."""


class UnknownThread(FunduqError):
    """The thread id names no thread (of this agent)."""


class RunNotFound(FunduqError):
    """The run id names no run."""


class InvalidRunInput(FunduqError):
    """The body does not validate as a RunAgentInput."""


class ThreadQueueFull(FunduqError):
    """The thread already holds thread_queue_limit pending runs."""


class RunNotCancellable(FunduqError):
    """The run is paused (input-required) or has ended; a cancel cannot reach it."""


class RunNotPaused(FunduqError):
    """An answer names a run that is not waiting for one."""


class NotAuthorized(FunduqError):
    """The request lacks the authority a bound thread demands. Deliberately
    says nothing about the run's state."""


class ProofsBusy(FunduqError):
    """funduq already keeps as many fresh spent proofs as it may
    (FUNDUQ_MAX_SPENT_PROOFS); a new proof cannot be accepted until some expire."""
