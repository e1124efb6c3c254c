"""Push notifications: the durable outbox and its deliverers (DESIGN §10).

A push config (task, id, url, token) is a row of `push_configs` that also holds
its delivery cursor: the place, in the task's update order, of the last update
the receiver acknowledged with a 2xx. One deliverer task per config that is
still delivering follows the run from the record (`Funduq.follow`), projects
each event into the A2A stream updates a SendStreamingMessage stream carries
(`TaskProjection`), skips what the cursor says went out already, POSTs the
rest one at a time, in order, and moves the cursor durably after each 2xx. So
a restart of funduq loses no update and repeats none (one exception: a crash
between a receiver's 2xx and the cursor's commit repeats that one update, with
the same `jti`). At start every config not finished resumes.

An update that fails (no connection, a timeout, a non-2xx answer) is tried
again after `protocol.push.backoff_delay`; after FUNDUQ_PUSH_MAX_ATTEMPTS
attempts at one update the config gives up: it is recorded `given_up` with the
last error and nothing more goes to it. A config whose task ended and whose
final status update was delivered is `done`.

On a shared record (several nodes on one PostgreSQL, docs/cluster.md) each
config is delivered by one node at a time: the one holding its delivery lease
(a node and an expiry on the database's clock, in the config's row). The node
that makes a config takes its lease in the same transaction; the facade's
lease task renews the leases of every config delivered here and claims the
lapsed ones (a dead node's) in one transaction a round (`renew`); a config
that ends lets its lease go. A cursor advance (and a config's end) is fenced
by the lease: a node whose lease another node took writes nothing, and its
deliverer stops. The new holder goes on from the durable cursor, so across a
takeover at most the update in flight repeats (same `jti`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx
import trio
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from .. import jose
from ..protocol import agui, push, statuses
from ..protocol.a2a.projection import TaskProjection
from ..protocol.push import SETTLE, TargetRefused
from .errors import PushConfigNotFound, PushRefused
from .store import PUSH_DELIVERING

log = logging.getLogger("funduq.pushes")

DELIVERING, DONE, GIVEN_UP = PUSH_DELIVERING, "done", "given_up"


class _GiveUp(Exception):
    pass


class _Lost(Exception):
    """The config's delivery lease is another node's (or the config is gone)."""


@dataclass
class PushConfig:
    task_id: str
    id: str
    url: str
    token: str
    authentication: dict[str, Any]
    cursor: tuple[int, int]
    state: str = DELIVERING

    def as_proto(self) -> pb.TaskPushNotificationConfig:
        config = pb.TaskPushNotificationConfig(
            id=self.id, task_id=self.task_id, url=self.url, token=self.token
        )
        if self.authentication:
            config.authentication.CopyFrom(
                pb.AuthenticationInfo(
                    scheme=str(self.authentication.get("scheme") or ""),
                    credentials=str(self.authentication.get("credentials") or ""),
                )
            )
        return config


def _config(row: Any) -> PushConfig:
    """A push config from its row (``store.PUSH_COLUMNS``)."""
    task_id, cid, url, token, auth, seq, index, state = row
    return PushConfig(task_id, cid, url, token, json.loads(auth), (seq, index), state)


Resolver = Callable[[str, int], Any]


def _starts_a_turn(event: Any) -> bool:
    return isinstance(event, dict) and event.get("type") == agui.RUN_STARTED


async def _resolve(host: str, port: int) -> list[str]:
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class _VettedConnects(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend, but a TCP connection goes only to an address
    `vouch(host, port)` just vouched for. The host is resolved once, here,
    and the very address that was checked is dialled: a DNS answer that
    changes between a check and the connect (rebinding) cannot steer a push
    inside. Host header, SNI and certificate checks still name the URL's
    host -- httpcore takes them from the URL, not from what was dialled."""

    def __init__(self, vouch: Callable[[str, int], Awaitable[list[str]]]) -> None:
        self._vouch = vouch
        self._trio = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self._vouch(host, port)
        except PushRefused as exc:
            raise httpcore.ConnectError(str(exc)) from None
        failure: Exception = httpcore.ConnectError(f"{host} resolves to no address")
        for address in addresses:
            try:
                return await self._trio.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("push targets are TCP hosts only")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


class PushSlot:
    """Room for one more delivering config, held from a door's `vet` of an
    inline config until `create` records it (or the run is refused and the
    door releases it): a config vetted before its run starts cannot then be
    refused for want of room after the run started."""

    def __init__(self, pushes: Pushes) -> None:
        self._pushes: Pushes | None = pushes
        pushes._reserved += 1

    def release(self) -> None:
        """Give the room back (again is a no-op)."""
        if self._pushes is not None:
            self._pushes._reserved -= 1
            self._pushes = None


Vouch = Callable[[str, int], Awaitable[list[str]]]


def _pinned_transport(vouch: Vouch) -> httpx.AsyncHTTPTransport:
    """httpx's transport with its connection pool dialling through
    `_VettedConnects` (httpx has no public hook for the network backend)."""
    transport = httpx.AsyncHTTPTransport(trust_env=False)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(trust_env=False),
        network_backend=_VettedConnects(vouch),
    )
    return transport


class Pushes:
    """The push configs of every task and their deliverers. Made and run by
    the facade: ``await nursery.start(pushes.run)``."""

    def __init__(self, funduq: Any, *, resolve: Resolver = _resolve) -> None:
        self.funduq = funduq
        self.settings = funduq.settings
        self.record = funduq.record
        self._resolve = resolve
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[tuple[str, str], trio.CancelScope] = {}
        #: The config each deliverer here delivers (by the same key).
        self._configs: dict[tuple[str, str], PushConfig] = {}
        #: Several nodes share the record: configs are delivered under a lease.
        self.shared = bool(getattr(self.record, "shared", False)) and (
            getattr(self.record, "node", None) is not None
        )
        self._resumed: dict[str, trio.Event] = {}
        #: Slots held by inline configs between `vet` and `create`.
        self._reserved = 0
        #: Deliverers per task: the last one out drops the task's `_resumed`.
        self._following: dict[str, int] = {}
        self._http: httpx.AsyncClient | None = None
        #: Counters (GET /metrics) and a wake-up for whoever watches them.
        self.delivered = 0
        self.failed_attempts = 0
        self.given_up = 0
        #: Configs this node took over from another (lapsed lease), and
        #: configs it stopped delivering because another node took them.
        self.taken_over = 0
        self.let_go = 0
        self._changed = trio.Event()

    # -- life

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # The table is the record's (schema migration 4 on either store). On
        # a shared record only the configs nobody delivers (their lease lapsed
        # or is nobody's) are this node's to resume.
        if self.shared:
            rows = await self.record.claim_push_configs()
            self.taken_over += len(rows)
        else:
            rows = await self.record.push_configs_delivering()
        timeout = httpx.Timeout(self.settings.push_timeout_seconds)
        async with (
            httpx.AsyncClient(
                timeout=timeout,
                follow_redirects=False,
                trust_env=False,
                transport=_pinned_transport(self._addresses),
            ) as http,
            trio.open_nursery() as nursery,
        ):
            self._http = http
            self._nursery = nursery
            for row in rows:
                self._start(_config(row))
            task_status.started()
            await trio.sleep_forever()

    def _start(self, config: PushConfig) -> None:
        assert self._nursery is not None
        scope = trio.CancelScope()
        self._scopes[(config.task_id, config.id)] = scope
        self._configs[(config.task_id, config.id)] = config
        # In the broker's own context, not the HTTP request's that made the
        # config (a deliverer outlives it; see Funduq._start_lane).
        self.funduq._context.run(
            functools.partial(self._nursery.start_soon, name=f"push {config.task_id}/{config.id}"),
            self._deliverer,
            config,
            scope,
        )

    async def renew(self) -> None:
        """One round of the delivery leases (a shared record; called by the
        facade's lease task): renew those of the configs delivered here, stop
        delivering those another node took (or that were deleted there), and
        start delivering the lapsed ones this node claimed."""
        if not self.shared or self._nursery is None:
            return
        snapshot = dict(self._scopes)
        ours, claimed = await self.record.renew_push_leases(list(snapshot))
        for key, scope in snapshot.items():
            config = self._configs.get(key)
            if (
                key not in ours
                and self._scopes.get(key) is scope
                and config is not None
                and config.state == DELIVERING
            ):
                log.warning(
                    "push config %s/%s: no longer this node's to deliver (another node "
                    "holds its lease, or it was deleted there); letting go",
                    *key,
                )
                self._let_go(key)
        for row in claimed:
            config = _config(row)
            key = (config.task_id, config.id)
            if key in self._scopes:
                continue  # delivered here: its lease lapsed while it went unrenewed
            log.warning(
                "push config %s/%s: its node stopped delivering it; taking over from %s",
                *key,
                config.cursor,
            )
            self.taken_over += 1
            self._start(config)
        if claimed:
            self._note()

    def _let_go(self, key: tuple[str, str]) -> None:
        scope = self._scopes.pop(key, None)
        self._configs.pop(key, None)
        if scope is not None:
            scope.cancel()
            self.let_go += 1
            self._note()

    def resumed(self, task_id: str) -> None:
        """The paused task took an answer: its deliverers follow it again."""
        event = self._resumed.pop(task_id, None)
        if event is not None:
            event.set()

    def gauges(self) -> dict[str, tuple[str, float]]:
        return {
            "funduq_push_delivered": (
                "Push notifications a receiver acknowledged.",
                self.delivered,
            ),
            "funduq_push_failed_attempts": (
                "Push notification attempts that failed.",
                self.failed_attempts,
            ),
            "funduq_push_given_up": (
                "Push configs given up after the last attempt.",
                self.given_up,
            ),
            "funduq_push_delivering": ("Push configs with a deliverer.", len(self._scopes)),
            **(
                {
                    "funduq_push_taken_over_total": (
                        "Push configs this node took over (their delivery lease lapsed).",
                        self.taken_over,
                    ),
                    "funduq_push_let_go_total": (
                        "Push configs this node stopped delivering: another node took them.",
                        self.let_go,
                    ),
                }
                if self.shared
                else {}
            ),
        }

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition()` holds, re-checked whenever a delivery
        succeeds, fails or gives up (for tests and operators' tools)."""
        while not condition():
            await self._changed.wait()

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- configs (the door's operations)

    async def check_url(self, url: str) -> push.Target:
        """The target, or PushRefused: http(s), bounded, and -- unless
        FUNDUQ_PUSH_ALLOW_PRIVATE -- a host on public addresses only."""
        try:
            target = push.check_target(url)
        except TargetRefused as exc:
            raise PushRefused(str(exc)) from None
        if not self.settings.push_allow_private:
            await self._addresses(target.host, target.port)
        return target

    async def _addresses(self, host: str, port: int) -> list[str]:
        """The addresses a push to `host` may connect to, or PushRefused: all
        of them public unless FUNDUQ_PUSH_ALLOW_PRIVATE (then `host` itself,
        resolved by the connect). Each delivery's connect asks this afresh
        and dials only what it answered (`_VettedConnects`)."""
        if self.settings.push_allow_private:
            return [host]
        addresses: list[str] = []
        # A resolver that does not answer is a host funduq cannot vouch for.
        with trio.move_on_after(self.settings.push_timeout_seconds):
            try:
                addresses = await self._resolve(host, port)
            except OSError:
                pass
        if push.any_blocked(addresses):
            raise PushRefused(
                "push url's host is not a public address (or does not resolve); "
                "loopback and private targets need FUNDUQ_PUSH_ALLOW_PRIVATE"
            )
        return addresses

    async def reserve(
        self, config: pb.TaskPushNotificationConfig, task_id: str | None = None
    ) -> PushSlot:
        """Vet an inline config before the run it is for starts (or the
        paused `task_id` it answers resumes) and hold its room: `create`
        with the slot then refuses nothing. The door releases the slot
        whatever happens (`PushSlot.release`)."""
        await self.vet(config)
        if task_id is not None and config.id not in await self._config_ids(task_id):
            held = len(await self._config_ids(task_id))
            if held >= self.settings.push_configs_per_task:
                raise PushRefused(
                    f"task has {held} push configs already (FUNDUQ_PUSH_CONFIGS_PER_TASK)"
                )
        return PushSlot(self)

    async def _config_ids(self, task_id: str) -> set[str]:
        return {row[1] for row in await self.record.push_configs(task_id)}

    async def vet(self, config: pb.TaskPushNotificationConfig) -> None:
        """Refuse (PushRefused) a config `create` would refuse for its own
        fields or for want of room."""
        await self.check_url(config.url)
        if len(config.token) > push.MAX_TOKEN_CHARS:
            raise PushRefused(f"push token longer than {push.MAX_TOKEN_CHARS} characters")
        if not push.header_value_ok(config.token):  # it is sent as a header
            raise PushRefused("push token must be printable ASCII")
        if config.id and (len(config.id) > push.MAX_ID_CHARS or not config.id.isprintable()):
            raise PushRefused(f"push config id must be printable, at most {push.MAX_ID_CHARS}")
        if config.HasField("authentication"):
            auth = config.authentication
            if len(auth.scheme) + len(auth.credentials) > push.MAX_TOKEN_CHARS:
                raise PushRefused("push authentication too long")
            problem = push.auth_problem(auth.scheme, auth.credentials)
            if problem:
                raise PushRefused(problem)
        if len(self._scopes) + self._reserved >= self.settings.push_max_active:
            raise PushRefused(
                "funduq delivers to as many push configs as it may (FUNDUQ_PUSH_MAX_ACTIVE)"
            )

    async def create(
        self,
        task_id: str,
        config: pb.TaskPushNotificationConfig,
        *,
        from_start: bool,
        slot: PushSlot | None = None,
    ) -> pb.TaskPushNotificationConfig:
        """Record a config for the task and start delivering to it. A config
        made with the task (`from_start`) gets every update; one added later
        gets those of events recorded from now on and the status updates of
        the turn now under way (a paused task's current status at once).
        With a `slot` (from `reserve`) the config was vetted and its room
        held already: nothing is refused, and the slot is used up."""
        if slot is None:
            await self.vet(config)
        config_id = config.id or secrets.token_hex(8)
        auth: dict[str, str] = {}
        if config.HasField("authentication"):
            auth = {
                "scheme": config.authentication.scheme,
                "credentials": config.authentication.credentials,
            }
        if from_start:
            cursor = (0, -1)
        else:
            record = await self.funduq.get_run(task_id)
            last = max((e["seq"] for e in (record or {}).get("events") or ()), default=0)
            cursor = (last, SETTLE - 1)  # the status as it stands is still to go
        row = PushConfig(task_id, config_id, config.url, config.token, auth, cursor)
        try:
            # With a slot the room is held already: the store checks none.
            refused = await self.record.put_push_config(
                task_id,
                config_id,
                row.url,
                row.token,
                json.dumps(auth),
                cursor,
                per_task=None if slot is not None else self.settings.push_configs_per_task,
                active=None if slot is not None else self.settings.push_max_active,
            )
            if refused is not None:
                why, count = refused
                raise PushRefused(
                    {
                        "per_task": f"task has {count} push configs already "
                        "(FUNDUQ_PUSH_CONFIGS_PER_TASK)",
                        "active": "funduq delivers to as many push configs as it may "
                        "(FUNDUQ_PUSH_MAX_ACTIVE)",
                        "unrecordable": "push config holds a character funduq cannot record "
                        "(NUL or a lone surrogate)",
                    }[why]
                )
            old = self._scopes.pop((task_id, config_id), None)
            self._configs.pop((task_id, config_id), None)
            if old is not None:  # replaced: the old deliverer stops
                old.cancel()
            self._start(row)  # its scope now holds the room the slot held
        finally:
            if slot is not None:
                slot.release()
        return row.as_proto()

    async def get(self, task_id: str, config_id: str) -> pb.TaskPushNotificationConfig:
        row = await self.record.push_config(task_id, config_id)
        if row is None:
            raise PushConfigNotFound(config_id)
        return _config(row).as_proto()

    async def list(self, task_id: str) -> list[pb.TaskPushNotificationConfig]:
        rows = await self.record.push_configs(task_id)
        return [_config(r).as_proto() for r in rows]

    async def delete(self, task_id: str, config_id: str) -> None:
        deleted = await self.record.delete_push_config(task_id, config_id)
        if not deleted:
            raise PushConfigNotFound(config_id)
        scope = self._scopes.pop((task_id, config_id), None)
        self._configs.pop((task_id, config_id), None)
        if scope is not None:
            scope.cancel()

    # -- delivery

    async def _deliverer(self, config: PushConfig, scope: trio.CancelScope) -> None:
        key = (config.task_id, config.id)
        self._following[config.task_id] = self._following.get(config.task_id, 0) + 1
        with scope:
            try:
                await self._follow(config)
            except _GiveUp:
                pass
            except _Lost:
                # Another node holds its lease now (it lapsed here), or the
                # config was deleted or replaced there: nothing more from here.
                log.warning(
                    "push config %s/%s: no longer this node's to deliver (another node "
                    "holds its lease, or it was deleted or replaced); letting go",
                    *key,
                )
                self.let_go += 1
            except Exception:
                log.exception("push deliverer of %s/%s failed", *key)
            finally:
                self._following[config.task_id] -= 1
                if not self._following[config.task_id]:
                    del self._following[config.task_id]
                    self._resumed.pop(config.task_id, None)
        if self._scopes.get(key) is scope:
            del self._scopes[key]
            self._configs.pop(key, None)
        self._note()

    async def _follow(self, config: PushConfig) -> None:
        task_id = config.task_id
        record = await self.funduq.get_run(task_id)
        if record is None:
            await self._finish(config, DONE, "task not found")
            return
        projection = TaskProjection(task_id=task_id, context_id=str(record["threadId"]))
        #: An interrupt's RUN_FINISHED not yet known to have closed its turn.
        interrupted: tuple[int, dict[str, Any]] | None = None
        while True:
            follow = self.funduq.follow(task_id, after_seq=projection.last_seq)
            async with contextlib.aclosing(follow) as bursts:
                async for burst in bursts:
                    for seq, event in burst:
                        if interrupted is not None and _starts_a_turn(event):
                            # The task paused there and was answered before
                            # this deliverer got that far (it lagged, or
                            # funduq restarted since): the pause's status
                            # update, at the place a live one has. (An
                            # interrupt followed by anything else, e.g.
                            # funduq's RUN_ERROR, was no pause.)
                            at, finished = interrupted
                            paused = {
                                "status": statuses.INPUT_REQUIRED,
                                "metadata": {"interrupts": agui.interrupts_of(finished)},
                            }
                            await self._send(config, (at, SETTLE), projection.settle(paused))
                        interrupted = (
                            (seq, event)
                            if isinstance(event, dict) and agui.outcome_of(event) == "interrupt"
                            else None
                        )
                        for index, update in enumerate(projection.apply(seq, event)):
                            await self._send(config, (seq, index), update)
            resumed = self._resumed.setdefault(task_id, trio.Event())
            record = await self.funduq.wait_run(task_id)
            if (
                record.get("status") not in statuses.TERMINAL
                and record.get("status") != statuses.INPUT_REQUIRED
                and self.funduq.watchers is None
                and task_id not in self.funduq.lanes
            ):
                # Neither settled nor paused, and no lane has it: its lane's
                # last write failed and so did settling the fault. On a
                # record only this process writes nothing changes that
                # before a restart, which settles the run and resumes this
                # config from its cursor; following it again now would only
                # read the record in a loop.
                log.warning(
                    "push config %s/%s: task %s left %s by a fault; delivered after a restart",
                    config.task_id,
                    config.id,
                    task_id,
                    record.get("status"),
                )
                return
            recorded = max((e["seq"] for e in record.get("events") or ()), default=0)
            if recorded > projection.last_seq:
                # A pause was answered before this read it (wait_run waited
                # for the next turn): follow what that turn recorded first.
                continue
            settled = projection.settle(record)
            await self._send(config, (projection.last_seq, SETTLE), settled)
            interrupted = None
            if record.get("status") in statuses.TERMINAL:
                await self._finish(config, DONE, None)
                return
            # Paused: wait for the answer (unless it came already -- and the
            # turn it started may have paused again since: then it recorded
            # past what this deliverer followed).
            while task_id not in self.funduq.lanes:
                current = await self.funduq.get_run(task_id)
                if current is None or current.get("status") != statuses.INPUT_REQUIRED:
                    break
                if (
                    max((e["seq"] for e in current.get("events") or ()), default=0)
                    > projection.last_seq
                ):
                    break
                if self.funduq.watchers is not None:
                    # A shared record: the answer may come to another node;
                    # the record's news of the task wakes this instead.
                    await self.funduq.wait_reopened(task_id, projection.last_seq)
                else:
                    await resumed.wait()
                resumed = self._resumed.setdefault(task_id, trio.Event())

    async def _finish(self, config: PushConfig, state: str, error: str | None) -> None:
        config.state = state
        await self.record.end_push_config(config.task_id, config.id, state, error)

    async def _send(
        self, config: PushConfig, key: tuple[int, int], update: pb.StreamResponse
    ) -> None:
        """POST one update until a 2xx (then move the cursor) or give up."""
        if key <= config.cursor:
            return  # the receiver has it
        body = json.dumps(MessageToDict(update), separators=(",", ":")).encode("utf-8")
        failures = 0
        while True:
            error = await self._attempt(config, key, body)
            if error is None:
                break
            failures += 1
            self.failed_attempts += 1
            self._note()
            log.info(
                "push to %s for %s failed (%d): %s", config.url, config.task_id, failures, error
            )
            if failures >= self.settings.push_max_attempts:
                self.given_up += 1
                await self._finish(config, GIVEN_UP, error)
                self._note()
                raise _GiveUp
            await trio.sleep(push.backoff_delay(failures, self.settings.push_backoff_seconds))
        if not await self.record.push_delivered(config.task_id, config.id, key, failures + 1):
            raise _Lost
        config.cursor = key
        self.delivered += 1
        self._note()

    async def _attempt(self, config: PushConfig, key: tuple[int, int], body: bytes) -> str | None:
        """One POST; None on a 2xx, else what went wrong."""
        assert self._http is not None
        # The host is vetted again by the connect itself (DNS may have
        # changed since the config was made): see `_VettedConnects`.
        identity = self.funduq.identity
        claims = push.delivery_claims(
            issuer=identity.fingerprint,
            task_id=config.task_id,
            config_id=config.id,
            key=key,
            body=body,
            now=time.time(),
        )
        token = jose.compact_jws(identity, json.dumps(claims, separators=(",", ":")).encode())
        # The receiver's own credentials take `Authorization` when the config
        # names them (A2A §4.3.2, the TCK's PUSH-DELIVER-001); the signature
        # is always in its own header, and in `Authorization` otherwise.
        authorization = push.authorization_of(
            str(config.authentication.get("scheme") or ""),
            str(config.authentication.get("credentials") or ""),
        )
        headers = {
            "Content-Type": "application/json",
            "Authorization": authorization or f"Bearer {token}",
            push.SIGNATURE_HEADER: token,
        }
        if config.token:
            headers["X-A2A-Notification-Token"] = config.token
        status = None
        # The whole POST is bounded, not only each of its reads and writes.
        with trio.move_on_after(self.settings.push_timeout_seconds):
            try:
                # Streamed and never read: a receiver's answer is its status alone.
                async with self._http.stream(
                    "POST", config.url, content=body, headers=headers
                ) as response:
                    status = response.status_code
            except (httpx.HTTPError, OSError) as exc:
                return f"{type(exc).__name__}: {exc}"
        if status is None:
            return f"no answer in {self.settings.push_timeout_seconds} s"
        if 200 <= status < 300:
            return None
        return f"HTTP {status}"
