"""The webhook dispatcher: announces ended runs and delivers due messages (a thread in ``rlrun serve``).

Each pass:
1. :func:`announce_ended_runs` queues one delivery per matching webhook for every run that ended;
2. due deliveries are claimed (their ``next_attempt_at`` pushed past this attempt's timeout, so another
   process skips them), then POSTed outside any transaction, up to ``PARALLEL_ATTEMPTS`` at a time,
   signed per attempt (Standard Webhooks), to the address the allow-list check just approved;
   redirects are not followed, and the connection itself refuses any address the allow-list would not
   accept, checking both the address it is given and the peer of the socket it opened;
3. each outcome is logged on the delivery: 2xx succeeds, anything else retries with exponential backoff
   until ``webhook_max_attempts`` (the bounded time is the sum of those waits).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpcore
import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from api.models import Webhook, WebhookDelivery, utcnow
from api.services.webhooks import announce_ended_runs, record_attempt
from api.settings import Settings
from api.webhook_signing import signed_headers
from api.webhook_urls import (
    Resolver,
    UrlPolicy,
    WebhookUrlRefused,
    address_refusal,
    check_webhook_url,
    pinned_target,
    resolve,
)

log = logging.getLogger("rlrun.webhooks")
PARALLEL_ATTEMPTS = 8


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str | None
    duration_ms: float


Sender = Callable[[str, str, dict[str, str], str], Outcome]  # url, body, headers, server name


def _refuse_unless_allowed(address: str, policy: UrlPolicy) -> None:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a host name here means the URL was not pinned to a checked address
        raise httpcore.ConnectError(f"refused at connect: {address!r} is not a checked address") from None
    reason = address_refusal(ip, policy)
    if reason is not None:
        raise httpcore.ConnectError(f"refused at connect: {address}: {reason}")


class CheckedBackend(httpcore.SyncBackend):
    """TCP connections only to IP addresses the allow-list accepts: the address asked for is checked
    before connecting and the socket's peer after, so nothing reaches an address that skipped the check
    (an unpinned URL, a name resolved again)."""

    def __init__(self, policy: UrlPolicy):
        self._policy = policy

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        _refuse_unless_allowed(host, self._policy)
        stream = super().connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            _refuse_unless_allowed(str(stream.get_extra_info("socket").getpeername()[0]), self._policy)
        except httpcore.ConnectError:
            stream.close()
            raise
        return stream


def checked_transport(policy: UrlPolicy) -> httpx.HTTPTransport:
    """httpx's transport (no proxies from the environment) whose connections go through
    :class:`CheckedBackend`."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx takes no network backend, so swap its pool for one with ours (same TLS settings; its pool
    # limits do not matter: a client sends one request).
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(trust_env=False), network_backend=CheckedBackend(policy)
    )
    return transport


def http_sender(timeout: float, policy: UrlPolicy) -> Sender:
    """POST with httpx to an already-pinned URL; the TLS server name is the webhook's host. The connection
    is checked against ``policy`` again as it is made (:class:`CheckedBackend`)."""

    def send(url: str, body: str, headers: dict[str, str], server_name: str) -> Outcome:
        start = time.perf_counter()
        try:
            with httpx.Client(
                transport=checked_transport(policy), timeout=timeout, follow_redirects=False, trust_env=False
            ) as client:
                response = client.post(
                    url, content=body.encode(), headers=headers, extensions={"sni_hostname": server_name}
                )
            ms = (time.perf_counter() - start) * 1000
            ok = 200 <= response.status_code < 300
            error = None if ok else f"HTTP {response.status_code}: {response.text[:200]}"
            return Outcome(response.status_code, error, ms)
        except httpx.HTTPError as exc:
            ms = (time.perf_counter() - start) * 1000
            return Outcome(None, f"{type(exc).__name__}: {exc}"[:300], ms)

    return send


@dataclass(frozen=True)
class ClaimedDelivery:
    """A due delivery this process took, with what one attempt needs."""

    delivery_id: uuid.UUID
    url: str
    secret: str
    message_id: str
    body: str


def _claim_due(
    session_factory: sessionmaker[Session], settings: Settings, limit: int
) -> list[ClaimedDelivery]:
    now = utcnow()
    lease_until = now + timedelta(seconds=settings.webhook_timeout_seconds + 30)
    claimed: list[ClaimedDelivery] = []
    with session_factory.begin() as session:
        rows = session.execute(
            select(WebhookDelivery, Webhook)
            .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
            .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(limit)
            .with_for_update(skip_locked=True, of=WebhookDelivery)
        ).all()
        for delivery, hook in rows:
            taken = session.execute(
                update(WebhookDelivery)
                .where(
                    WebhookDelivery.id == delivery.id,
                    WebhookDelivery.next_attempt_at == delivery.next_attempt_at,
                )
                .values(next_attempt_at=lease_until)
                .execution_options(synchronize_session=False)
            )
            if taken.rowcount == 1:  # type: ignore[attr-defined]
                claim = ClaimedDelivery(
                    delivery.id, hook.url, hook.secret, delivery.message_id, delivery.body
                )
                claimed.append(claim)
    return claimed


def attempt_delivery(claim: ClaimedDelivery, policy: UrlPolicy, resolver: Resolver, send: Sender) -> Outcome:
    """Check the URL now (DNS may have changed since registration), then send to the address it approved."""
    try:
        address = check_webhook_url(claim.url, policy, resolver)
    except WebhookUrlRefused as exc:
        return Outcome(None, f"refused by the allow-list: {exc.message}", 0.0)
    target = pinned_target(claim.url, address)
    headers = signed_headers(claim.secret, claim.message_id, int(time.time()), claim.body)
    headers["host"] = target.host_header
    headers["user-agent"] = "rlrun-webhooks/1"
    return send(target.url, claim.body, headers, target.server_name)


def deliver_due(
    session_factory: sessionmaker[Session],
    settings: Settings,
    *,
    send: Sender | None = None,
    resolver: Resolver = resolve,
    limit: int = 50,
) -> int:
    """Attempt every due delivery once; how many attempts were made."""
    policy = UrlPolicy.from_settings(settings)
    send = send or http_sender(settings.webhook_timeout_seconds, policy)
    claims = _claim_due(session_factory, settings, limit)
    if not claims:
        return 0
    # In parallel, so one slow receiver (up to its timeout) does not hold up everyone else's messages.
    with ThreadPoolExecutor(max_workers=min(PARALLEL_ATTEMPTS, len(claims))) as pool:
        outcomes = list(pool.map(lambda claim: attempt_delivery(claim, policy, resolver, send), claims))
    for claim, outcome in zip(claims, outcomes, strict=True):
        with session_factory.begin() as session:
            delivery = session.get(WebhookDelivery, claim.delivery_id)
            if delivery is None or delivery.status != "pending":  # its webhook was deleted meanwhile
                continue
            record_attempt(
                delivery,
                at=utcnow(),
                status_code=outcome.status_code,
                error=outcome.error,
                duration_ms=outcome.duration_ms,
                max_attempts=settings.webhook_max_attempts,
                backoff=settings.webhook_backoff_seconds,
                max_backoff=settings.webhook_max_backoff_seconds,
            )
            log.info(
                "webhook delivery %s attempt %d: %s",
                claim.message_id,
                len(delivery.attempts),
                outcome.error or outcome.status_code,
            )
    return len(claims)


def dispatch_once(session_factory: sessionmaker[Session], settings: Settings, **kwargs: Any) -> int:
    """Announce ended runs, then deliver what is due."""
    with session_factory.begin() as session:
        announce_ended_runs(session)
    return deliver_due(session_factory, settings, **kwargs)


class WebhookDispatcher(threading.Thread):
    """Runs :func:`dispatch_once` every ``webhook_poll_seconds`` until stopped."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings):
        super().__init__(name="rlrun-webhooks", daemon=True)
        self.session_factory = session_factory
        self.settings = settings
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.settings.webhook_poll_seconds):
            try:
                dispatch_once(self.session_factory, self.settings)
            except Exception:  # noqa: BLE001 - a DB hiccup must not kill the loop
                log.exception("webhook pass failed")

    def stop(self) -> None:
        self.stopped.set()
