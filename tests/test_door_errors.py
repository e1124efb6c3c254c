"""The one table that says how each broker exception reads at the doors."""

import inspect

from a2a.utils.errors import InternalError, TaskNotFoundError

from funduq_trio.broker import errors
from funduq_trio.identity import InvalidActorChain
from funduq_trio.web.door_errors import DOOR_ANSWERS, a2a_error, door_answer


def test_every_broker_error_has_its_own_row():
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors.FunduqError)
    ]
    assert set(classes) | {InvalidActorChain} == set(DOOR_ANSWERS)


def test_a_subclass_reads_as_its_nearest_ancestor():
    class Newer(errors.RunNotFound):
        pass

    assert door_answer(Newer("x")) is DOOR_ANSWERS[errors.RunNotFound]
    assert isinstance(a2a_error(Newer("x"), task_id="t"), TaskNotFoundError)


def test_a_record_that_cannot_write_is_503_and_an_a2a_internal_error():
    exc = errors.RecordUnavailable("disk full")
    assert (door_answer(exc).http_status, door_answer(exc).code) == (503, "record_unavailable")
    error = a2a_error(exc)
    assert isinstance(error, InternalError)
    assert error.data == {"reason": "record_unavailable"}


def test_anything_else_is_a_500():
    assert door_answer(ValueError("x")).http_status == 500
    assert isinstance(a2a_error(ValueError("x")), InternalError)
