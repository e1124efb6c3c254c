"""Failure reasons, exact strings (they land in ``metadata.failureReason``
and in the code of the RUN_ERROR funduq synthesizes). A refusal's reason is
the provider's own, recorded verbatim, and is not listed here."""

AGENT_OFFLINE = "agent_offline"
NO_PROVIDER_TOOK_IT = "no_provider_took_it"
PROVIDER_LEFT_HOLDING_IT = "provider_left_holding_it"
STREAM_ENDED_WITHOUT_FINISHING = "provider_stream_ended_without_finishing"
ORPHANED_BY_RESTART = "orphaned_by_restart"
#: The run's offer holds what the link cannot carry (a lone surrogate, NaN,
#: nesting past the limit): it fails alone, the offer never leaves.
OFFER_NOT_ENCODABLE = "offer_not_encodable"
MALFORMED_EVENT = "provider sent a malformed AG-UI event"
INVALID_INPUT_PREFIX = "input does not validate as RunAgentInput: "
# Reserved and never produced: a pause has no deadline of funduq's.
PAUSED_NO_RESUME = "paused_no_resume"
#: funduq itself failed while handling the run (a bug, or a record write it
#: could not make): the run fails alone and its provider is asked to stop.
FUNDUQ_ERROR = "funduq_error"
#: The run's offer frame could not be encoded for the link: the run fails alone.
OFFER_NOT_ENCODABLE = "offer_not_encodable"
