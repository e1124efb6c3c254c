"""ListTasks over run records, I/O-free: choosing a page, projecting it."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from a2a.types import a2a_pb2 as pb
from a2a.utils import constants
from a2a.utils.errors import InvalidParamsError
from a2a.utils.task import decode_page_token, encode_page_token

from .projection import status_of_state, task_from_record, task_state
from .structs import DEGRADED_KEY, set_struct, utf8

log = logging.getLogger("funduq_trio.a2a")


@dataclass(frozen=True)
class TaskPage:
    """One ListTasks page chosen over run records (records in page order)."""

    records: list[Mapping[str, Any]]
    total_size: int
    page_size: int
    next_page_token: str


def select_page(request: pb.ListTasksRequest, records: Iterable[Mapping[str, Any]]) -> TaskPage:
    """Choose one ListTasks page as the SDK's task store does: filter by status
    and status time, order newest status first (ties by id, descending), and
    page by a token naming the last task of the previous page."""
    wanted = status_of_state(request.status) if request.status else None
    after_ns = (
        request.status_timestamp_after.ToNanoseconds()
        if request.HasField("status_timestamp_after")
        else None
    )
    chosen: list[tuple[tuple[bool, int, str], Mapping[str, Any]]] = []
    for record in records:
        if wanted is not None and record.get("status") not in wanted:
            continue
        status = task_from_record(record, include_artifacts=False).status
        has = status.HasField("timestamp")
        ns = status.timestamp.ToNanoseconds() if has else 0
        if after_ns is not None and not (has and ns >= after_ns):
            continue
        chosen.append(((has, ns, str(record.get("runId"))), record))
    chosen.sort(key=lambda item: item[0], reverse=True)
    start = 0
    if request.page_token:
        last_id = decode_page_token(request.page_token)
        ids = [key[2] for key, _ in chosen]
        if last_id not in ids:
            raise InvalidParamsError(message="page token names no task of this listing")
        start = ids.index(last_id) + 1
    page_size = request.page_size or constants.DEFAULT_LIST_TASKS_PAGE_SIZE
    page = [record for _, record in chosen[start : start + page_size]]
    token = ""
    if page and start + page_size < len(chosen):
        token = encode_page_token(str(page[-1].get("runId")))
    return TaskPage(page, len(chosen), page_size, token)


def _listed_task(record: Mapping[str, Any], *, include_artifacts: bool) -> pb.Task:
    """One task of a listing. A record no projection can show (a bug, or a
    stored event nothing foresaw) is listed with its status alone, marked
    DEGRADED_KEY: one run never fails the listing of a whole agent."""
    try:
        return task_from_record(record, include_artifacts=include_artifacts)
    except Exception:  # noqa: BLE001 - logged; the listing goes on
        log.exception("run %s: its task cannot be projected; listed by status", record.get("runId"))
        task = pb.Task(
            id=utf8(str(record.get("runId"))),
            context_id=utf8(str(record.get("threadId"))),
            status=pb.TaskStatus(state=task_state(str(record.get("status")))),
        )
        set_struct(task.metadata, {DEGRADED_KEY: True})
        return task


def list_tasks_response(
    request: pb.ListTasksRequest, page: TaskPage, full_records: Iterable[Mapping[str, Any]]
) -> pb.ListTasksResponse:
    """The ListTasksResponse for `page`, its tasks built from the full records
    (with events, so artifacts and failure messages are there)."""
    return pb.ListTasksResponse(
        tasks=[_listed_task(r, include_artifacts=request.include_artifacts) for r in full_records],
        next_page_token=page.next_page_token,
        page_size=page.page_size,
        total_size=page.total_size,
    )
