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


class InvalidKyokOptIn(InvalidRunInput):
    """The request's `kyok` opt-in is malformed or names no known LLM offering."""


class ThreadQueueFull(FunduqError):
    """The thread already holds thread_queue_limit pending runs."""


class RunNotCancellable(FunduqError):
    """The run is paused (input-required) or has ended; a cancel cannot reach it."""


class RunNotPaused(FunduqError):
    """An answer names a run that is not waiting for one."""


class NotAuthorized(FunduqError):
    """The request lacks the authority a bound thread demands. Deliberately
    says nothing about the run's state."""


class QueueLimitReached(FunduqError):
    """funduq already holds as many waiting runs (or bytes of their input) as
    it is configured to; nothing was recorded, retry later (docs/limits.md)."""

    #: The setting whose bound was reached, and the caller-visible code.
    setting = ""
    code = "queue_limit_reached"

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.details = {"setting": self.setting, "limit": limit}


class QueuedRunsLimit(QueueLimitReached):
    """The runs waiting in funduq in all reached FUNDUQ_MAX_QUEUED_RUNS."""

    setting = "FUNDUQ_MAX_QUEUED_RUNS"
    code = "queued_runs_limit"


class AgentQueuedRunsLimit(QueueLimitReached):
    """The runs waiting for this agent reached FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT."""

    setting = "FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT"
    code = "agent_queued_runs_limit"


class QueuedInputLimit(QueueLimitReached):
    """The input held by waiting runs would pass FUNDUQ_MAX_QUEUED_INPUT_BYTES."""

    setting = "FUNDUQ_MAX_QUEUED_INPUT_BYTES"
    code = "queued_input_bytes_limit"


class TooManyAgents(FunduqError):
    """A register lists more agents than FUNDUQ_MAX_AGENTS_PER_PROVIDER."""


class RecordUnavailable(FunduqError):
    """The record cannot take writes right now (a full disk, an I/O error):
    no new run is taken until it can. Retry later."""


class ProofsBusy(FunduqError):
    """funduq already keeps as many fresh spent proofs as it may
    (FUNDUQ_MAX_SPENT_PROOFS); a new proof cannot be accepted until some expire."""


class PushRefused(FunduqError):
    """A push notification config funduq will not take (the message says why)."""


class PushConfigNotFound(FunduqError):
    """No such push notification config of that task."""


class ThreadLedElsewhere(FunduqError):
    """Another funduq node on the same PostgreSQL leads this thread (holds its
    lease) or alone serves its agent, and the request could not be forwarded
    there (docs/cluster.md, "Forwarding"): that node does not answer. Nothing
    was recorded. Retry shortly, or once its lease lapses."""
