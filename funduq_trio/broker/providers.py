"""Attached providers: who serves which agent, how many places each has left,
and the quality counters that outlive a connection.

A *session* is one attached link. Its places are spent the moment an offer
leaves and come back when the offer is not accepted or the held run ends.
The registry never decides a run's fate; it only tells lanes what happened
(a place freed, a provider came or went) and lets each lane decide.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from trio.lowlevel import Abort, RaiseCancelT

from ..identity import fingerprint_of
from .errors import TooManyAgents
from .inbox import Finish, Gone, Message, Wake
from .metrics import Metrics
from .run_machine import Verdict
from .store import COUNTERS, Store, dumps

log = logging.getLogger("funduq.providers")

ACCEPTED, DECLINED, REFUSED = Verdict.ACCEPTED, Verdict.DECLINED, Verdict.REFUSED
#: How many expired offers a session remembers, to answer a late acceptance.
EXPIRED_OFFERS_KEPT = 1024
VERDICTS = frozenset({ACCEPTED, DECLINED, REFUSED})


_entropy = bytearray()


def _offer_id() -> str:
    """``offer_`` + 16 random hex digits, the entropy drawn from the OS in
    blocks (as ``funduq._new_id``), not a system call per offer."""
    global _entropy
    if len(_entropy) < 8:
        _entropy = bytearray(secrets.token_bytes(4096))
    chunk = _entropy[:8]
    del _entropy[:8]
    return "offer_" + chunk.hex()


class ProviderLink(Protocol):
    """What the broker needs from a link (the WebSocket shell implements it).
    None of these may block: they queue a frame and return."""

    def send_offer(self, offer_id: str, run: dict[str, Any]) -> None: ...
    def send_cancel(self, run_id: str) -> None: ...
    def close(self, reason: str) -> None: ...


class Lane(Protocol):
    """A run's lane as the registry sees it: an id and an inbox to tell."""

    @property
    def run_id(self) -> str: ...

    def tell(self, message: Message) -> None: ...

    def report(self, event: Any) -> bool:
        """Tell a ``Report`` of ``event``; True when the lane is ``full`` then."""
        ...

    @property
    def full(self) -> bool: ...

    async def room(self) -> None: ...


class Offer:
    """One offer in flight: the answer slot its lane awaits.

    The slot is the offer itself, not a ``trio.Event``: an event and its
    parking lot were made per offer for the one task (the lane) that ever
    waits on it. ``wait`` behaves as ``Event.wait`` (a checkpoint, at once
    when answered; cancellable while it waits)."""

    __slots__ = (
        "id",
        "lane",
        "session",
        "verdict",
        "reason",
        "answered",
        "sent_at",
        "news",
        "_waiter",
    )

    def __init__(self, id: str, lane: Lane, session: ProviderSession) -> None:  # noqa: A002
        self.id = id
        self.lane = lane
        self.session = session
        self.verdict: str | None = None
        self.reason: str | None = None
        #: Resolved: answered, or the link went away (``verdict`` None).
        self.answered = False
        self.sent_at = 0.0  # trio clock: when it was handed to the link
        #: The provider's news count (``Providers.news``) when it answered.
        self.news = 0
        self._waiter: trio.lowlevel.Task | None = None

    def resolve(self, verdict: str | None, reason: str | None = None) -> None:
        if not self.answered:
            self.verdict, self.reason = verdict, reason
            self.answered = True
            waiter, self._waiter = self._waiter, None
            if waiter is not None:
                trio.lowlevel.reschedule(waiter)

    async def wait(self) -> None:
        """Until resolved (one waiter: the offer's lane)."""
        if self.answered:
            await trio.lowlevel.checkpoint()
            return
        if self._waiter is not None:
            raise trio.BusyResourceError("an offer has one waiter: its lane")
        self._waiter = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: RaiseCancelT) -> Abort:
        self._waiter = None
        return Abort.SUCCEEDED


@dataclass(frozen=True)
class AgentView:
    key: str
    fingerprint: str
    name: str
    description: str
    card: dict[str, Any]
    metadata: dict[str, Any]
    online: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "provider": self.key,
            "fingerprint": self.fingerprint,
            "name": self.name,
            "description": self.description,
            "online": self.online,
        }


class ProviderSession:
    """One attached provider link, as the broker sees it."""

    def __init__(
        self, registry: Providers, key: str, max_concurrent: int | None, link: ProviderLink
    ) -> None:
        self.registry = registry
        self.key = key
        self.fingerprint = fingerprint_of(key)
        self.max_concurrent = max_concurrent
        self.link = link
        self.live = True
        self.in_use = 0
        self.agents: dict[str, dict[str, Any]] = {}
        self.offers: dict[str, Offer] = {}
        self.held: dict[str, Lane] = {}
        #: Offers funduq stopped waiting for, by id -> run id (most recent kept).
        self.expired: dict[str, str] = {}
        #: Runs this link took late while a newer offer of them was out here:
        #: asked to stop once that offer is answered other than accepted, or
        #: withdrawn (see ``answer``). At most one per offer out.
        self.stale_takes: set[str] = set()
        # trio.current_time without its two calls through the runner: the
        # link's every frame reads it.
        self._now = trio.lowlevel.current_clock().current_time
        #: When the link last delivered anything (trio clock): see Lane._offer.
        self.last_heard = self._now()
        #: Lanes this link reported to that are behind (see ``can_read``).
        self.behind: dict[int, Lane] = {}

    # -- places ------------------------------------------------------------

    def has_room(self) -> bool:
        return self.max_concurrent is None or self.in_use < self.max_concurrent

    def reserve(self, lane: Lane) -> Offer:
        """Spend a place for an offer about to leave. Spent at once, before
        any await, so two lanes that both saw room cannot both take it."""
        self.in_use += 1
        return Offer(_offer_id(), lane, self)

    def send(self, offer: Offer, run: dict[str, Any]) -> None:
        """Send a reserved offer. A session that has gone answers at once."""
        if not self.live:
            offer.resolve(None)
            return
        self.offers[offer.id] = offer
        offer.sent_at = self._now()
        self.link.send_offer(offer.id, run)

    def withdraw(self, offer: Offer) -> None:
        """The lane stopped waiting: a later answer to this offer is ignored
        (an acceptance is asked to stop -- see ``answer``)."""
        if self.offers.pop(offer.id, None) is not None and not offer.answered:
            self.expired[offer.id] = offer.lane.run_id
            self._stop_stale_take(offer.lane.run_id)
            if len(self.expired) > EXPIRED_OFFERS_KEPT:
                del self.expired[next(iter(self.expired))]

    def give_back(self, *, wake: bool = True) -> None:
        """A place came back. A decline gives its place back silently: the
        provider just said it is full, so it wakes nobody."""
        self.in_use = max(0, self.in_use - 1)
        if wake and self.live:
            self.registry.wake_for_room(self.key)

    def release(self, run_id: str) -> None:
        """A held run ended (settled or paused): its place frees."""
        if self.held.pop(run_id, None) is not None:
            self.give_back()

    def cancel(self, run_id: str) -> None:
        if self.live and run_id in self.held:
            self.link.send_cancel(run_id)

    def cancel_unheld(self, run_id: str) -> None:
        if self.live:
            self.link.send_cancel(run_id)

    # -- what the provider says --------------------------------------------

    async def register(self, agents: list[dict[str, Any]]) -> None:
        """Publish (replace) the agents this link serves. More than the
        registry's ``max_agents`` is refused (TooManyAgents), changing nothing."""
        published = {a["name"]: a for a in agents}
        if len(published) > self.registry.max_agents:
            raise TooManyAgents(
                f"a provider may publish at most {self.registry.max_agents} agents "
                f"(FUNDUQ_MAX_AGENTS_PER_PROVIDER); this register lists {len(published)}"
            )
        await self.registry.record_agents(self.key, list(published.values()))
        if not self.live:
            return
        dropped = set(self.agents) - set(published)
        self.agents = published
        self.registry.served_changed(self.key, dropped)

    def answer(self, offer_id: str, verdict: str, reason: str | None = None) -> None:
        self.last_heard = self._now()
        offer = self.offers.pop(offer_id, None)
        if offer is None:
            log.info(
                "provider %s answered offer %s after funduq stopped waiting",
                self.fingerprint,
                offer_id,
            )
            run_id = self.expired.pop(offer_id, None)
            if verdict == ACCEPTED and run_id is not None and run_id not in self.held:
                if self.offered(run_id):
                    # Not now: a cancel names a run, not an offer, so the
                    # provider would take it as being about the newer offer
                    # out -- stopping the play funduq is about to hold, which
                    # then ends without a RUN_FINISHED and no cancel asked
                    # (failed, for nobody's fault). Asked once that offer is
                    # answered other than accepted, or withdrawn.
                    self.stale_takes.add(run_id)
                else:
                    # It took a run funduq no longer offers it: ask it to stop,
                    # so it works for nobody no longer and a later offer finds
                    # it free (the cancel leaves before any later offer).
                    self.cancel_unheld(run_id)
            return
        self.registry.metrics.offer_answered(verdict, self.last_heard - offer.sent_at)
        if verdict == ACCEPTED:
            self.stale_takes.discard(offer.lane.run_id)  # its play is the one held now
        else:
            self._stop_stale_take(offer.lane.run_id)
        if verdict == ACCEPTED:
            # Held from the answer on: its events queue behind the answer in
            # the lane's inbox, and the lane claims the run when it reads it.
            self.held[offer.lane.run_id] = offer.lane
        offer.news = self.registry.news(self.key)
        offer.resolve(verdict, reason)

    def _stop_stale_take(self, run_id: str) -> None:
        """The offer that kept a late taker from being asked to stop is over."""
        if run_id in self.stale_takes:
            self.stale_takes.discard(run_id)
            self.cancel_unheld(run_id)

    def offered(self, run_id: str) -> bool:
        """An offer of this run is out on this link, its answer awaited."""
        return any(offer.lane.run_id == run_id for offer in self.offers.values())

    def report(self, run_id: str, event: Any) -> bool:
        self.last_heard = self._now()
        lane = self.held.get(run_id)
        if lane is None:
            return False
        if lane.report(event):
            self.behind[id(lane)] = lane
        return True

    async def can_read(self) -> None:
        """Return once every run this link reported to has room again: the
        link's reader awaits this before it reads the next message, so when
        funduq falls behind recording a provider's reports, it stops reading
        that provider (hypercorn's ``can_read``) instead of queueing without
        bound. The time spent waiting is funduq's, not the provider's silence."""
        waited = False
        while self.behind:
            _, lane = self.behind.popitem()
            if lane.full:
                waited = True
                await lane.room()
        if waited:
            self.last_heard = self._now()

    def finish(self, run_id: str) -> bool:
        self.last_heard = self._now()
        lane = self.held.get(run_id)
        if lane is None:
            return False
        lane.tell(Finish())
        return True

    async def thread_messages(self, thread_id: str, limit: int | None) -> list[dict[str, Any]]:
        return await self.registry.thread_messages(self.key, thread_id, limit)

    def detach(self) -> None:
        """The link is gone. Idempotent."""
        if not self.live:
            return
        self.live = False
        self.registry.session_gone(self)


class Providers:
    """The registry of providers, their agents, places and counters."""

    def __init__(
        self,
        record: Store,
        allowance: int,
        messages_of: Callable[[str, str, int | None], Awaitable[list[dict[str, Any]]]],
        metrics: Metrics,
        *,
        max_agents: int = 100,
        max_roster_bytes: int = 1024 * 1024,
    ) -> None:
        #: A key's recorded roster: at most this many agents, and agents it no
        #: longer serves are kept only within max_roster_bytes (docs/limits.md).
        self.max_agents = max_agents
        self.max_roster_bytes = max_roster_bytes
        self.messages_of = messages_of  # the facade's: (provider key, thread id, limit)
        self.metrics = metrics
        self.record = record
        self.allowance = allowance
        self.sessions: dict[str, ProviderSession] = {}
        self.counters: dict[str, dict[str, int]] = {}
        self.agents: dict[tuple[str, str], dict[str, Any]] = {}
        self.by_fingerprint: dict[str, str] = {}
        self.unserved: dict[tuple[str, str], float] = {}
        #: Called when what is served here changed (a provider published its
        #: agents): the facade claims lapsed threads of those agents at once.
        self.on_served: Callable[[], None] | None = None
        # Heads waiting on a provider: for a place (or after a decline), and
        # for their agent to be served at all. Insertion order is wait order.
        self.room_waiters: dict[str, dict[int, Lane]] = {}
        self.serve_waiters: dict[str, dict[int, Lane]] = {}
        #: How many wake-ups each provider key has sent (``news``).
        self._news: dict[str, int] = {}
        self.started_at = 0.0

    async def load(self) -> None:
        """Read counters and published agents back from the record (start-up:
        nothing is known yet, so every counter read is taken)."""
        await self.refresh()
        self.started_at = trio.current_time()

    async def refresh(self) -> None:
        """Read the published agents again (another node of a cluster took a
        provider's register): what this node did not know joins what it
        knows; its counters stay its own. The agents of a provider whose
        link is here are known first-hand: a read that started before its
        last register committed would bring back agents it let go."""
        providers, agents = await self.record.providers_and_agents()
        for key, fp, *counts in providers:
            self.counters.setdefault(key, dict(zip(COUNTERS, map(int, counts), strict=True)))
            self.by_fingerprint[fp] = key
        for key, name, description, card, metadata in agents:
            if self.serving_any(key):
                continue
            self.agents[(key, name)] = {
                "name": name,
                "description": description,
                "card": json.loads(card),
                "metadata": json.loads(metadata),
            }

    # -- lookups -------------------------------------------------------------

    def resolve_key(self, provider: str) -> str | None:
        provider = provider.lower()
        if len(provider) == 64:
            return provider if provider in self.counters else None
        return self.by_fingerprint.get(provider)

    def serving_any(self, key: str) -> bool:
        """Whether a link of this provider is attached here."""
        session = self.sessions.get(key)
        return session is not None and session.live

    def serving(self, key: str, name: str) -> ProviderSession | None:
        session = self.sessions.get(key)
        if session is not None and session.live and name in session.agents:
            return session
        return None

    def unserved_since(self, key: str, name: str) -> float:
        return self.unserved.get((key, name), self.started_at)

    def view(self, key: str, name: str) -> AgentView | None:
        agent = self.agents.get((key, name))
        if agent is None:
            return None
        return AgentView(
            key,
            fingerprint_of(key),
            name,
            agent.get("description") or "",
            agent.get("card") or {},
            agent.get("metadata") or {},
            self.serving(key, name) is not None,
        )

    def roster(self) -> list[AgentView]:
        return [v for k in sorted(self.agents) if (v := self.view(*k)) is not None]

    # -- sessions --------------------------------------------------------------

    def attach(self, key: str, max_concurrent: int | None, link: ProviderLink) -> ProviderSession:
        key = key.lower()
        session = ProviderSession(self, key, max_concurrent, link)
        old = self.sessions.get(key)
        self.sessions[key] = session
        self.counters.setdefault(key, dict.fromkeys(COUNTERS, 0))
        self.by_fingerprint[session.fingerprint] = key
        if old is not None and old.live:
            old.link.close("replaced by a newer connection under the same key")
            old.detach()
        return session

    async def record_agents(self, key: str, agents: list[dict[str, Any]]) -> None:
        fp = fingerprint_of(key)
        rows = [
            (
                key,
                a["name"],
                a.get("description") or "",
                dumps(a.get("card") or {}),
                dumps(a.get("metadata") or {}),
            )
            for a in agents
        ]
        listed = {row[1]: sum(map(len, row[1:])) for row in rows}

        forgotten = await self.record.record_agents(
            key,
            fp,
            rows,
            lambda recorded: agents_to_forget(
                recorded, listed, self.max_agents, self.max_roster_bytes
            ),
        )
        for name in forgotten:
            self.agents.pop((key, name), None)
            self.unserved.pop((key, name), None)
        for a in agents:
            self.agents[(key, a["name"])] = {
                k: a.get(k) for k in ("name", "description", "card", "metadata")
            }

    def served_changed(self, key: str, dropped: set[str]) -> None:
        now = trio.current_time()
        session = self.sessions.get(key)
        for name in list(session.agents) if session else ():
            self.unserved.pop((key, name), None)
        for name in dropped:
            self.unserved[(key, name)] = now
        self.wake(key)
        if self.on_served is not None:
            self.on_served()

    def session_gone(self, session: ProviderSession) -> None:
        key = session.key
        if self.sessions.get(key) is session:
            del self.sessions[key]
        now = trio.current_time()
        for name in session.agents:
            if self.serving(key, name) is None:
                self.unserved[(key, name)] = now
        for offer in list(session.offers.values()):
            offer.resolve(None)
        session.offers.clear()
        for lane in list(session.held.values()):
            lane.tell(Gone())
        self.wake(key)
        if self.on_served is not None:
            self.on_served()

    # -- waiting lanes -----------------------------------------------------------

    def wait(self, key: str, lane: Lane, *, for_room: bool) -> None:
        waiting = self.room_waiters if for_room else self.serve_waiters
        waiting.setdefault(key, {})[id(lane)] = lane

    def stop_waiting(self, key: str, lane: Lane) -> None:
        for waiting in (self.room_waiters, self.serve_waiters):
            lanes = waiting.get(key)
            if lanes is not None and lanes.pop(id(lane), None) is not None and not lanes:
                del waiting[key]

    def news(self, key: str) -> int:
        """How many times heads waiting on this provider were woken (or would
        have been, had one waited). A declined head compares it with the
        count at the decline before it waits: a place freed, or a re-publish,
        between the decline and its wait woke nobody, so it looks again
        instead (Lane._pending_wait)."""
        return self._news.get(key, 0)

    def _told(self, key: str) -> None:
        self._news[key] = self._news.get(key, 0) + 1

    def wake(self, key: str) -> None:
        """Something changed on this provider (it came, went or republished):
        every head waiting on it looks again."""
        self._told(key)
        for waiting in (self.room_waiters, self.serve_waiters):
            for lane in waiting.pop(key, {}).values():
                lane.tell(Wake())

    def wake_for_room(self, key: str) -> None:
        """A place freed: the longest-waiting head gets it, as a baton it
        passes on if it does not use the place (see Lane._pass_baton)."""
        self._told(key)
        waiting = self.room_waiters.get(key)
        if waiting:
            lane = waiting.pop(next(iter(waiting)))
            if not waiting:
                del self.room_waiters[key]
            lane.tell(Wake(baton=True))

    # -- quality -------------------------------------------------------------------

    async def count(self, key: str, counter: str) -> None:
        """Count a strike against a provider; at the allowance it is withdrawn."""
        counts = self.counters.setdefault(key, dict.fromkeys(COUNTERS, 0))
        counts[counter] += 1
        value = counts[counter]
        await self.record.set_counter(key, counter, value)
        if value >= self.allowance:
            self.withdraw(key, f"{counter} reached the allowance ({self.allowance})")

    def withdraw(self, key: str, why: str) -> None:
        session = self.sessions.get(key)
        if session is not None and session.live:
            log.warning("withdrawing provider %s: %s", session.fingerprint, why)
            session.link.close(f"withdrawn: {why}")
            session.detach()

    async def thread_messages(
        self, key: str, thread_id: str, limit: int | None
    ) -> list[dict[str, Any]]:
        return await self.messages_of(key, thread_id, limit)


def agents_to_forget(
    recorded: list[tuple[str, int]], listed: dict[str, int], max_agents: int, max_bytes: int
) -> list[str]:
    """Which of a key's recorded agents (``(name, size)``, oldest first) a
    register listing ``listed`` ({name: size}) makes funduq forget. The listed
    ones are all kept (there are at most ``max_agents``, in one frame); of the
    others -- no longer served, shown offline -- the most recently first
    recorded are kept while the key's roster stays within ``max_agents``
    agents and ``max_bytes`` bytes. So one key can never grow the roster
    (and ``GET /agents``) past that, however many registers it sends."""
    room = max_agents - len(listed)
    budget = max_bytes - sum(listed.values())
    forget = []
    for name, size in reversed(recorded):
        if name in listed:
            continue
        if room > 0 and size <= budget:
            room -= 1
            budget -= size
        else:
            forget.append(name)
    return forget
