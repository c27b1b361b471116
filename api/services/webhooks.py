"""Webhooks: registration, the delivery log, and turning ended runs into pending deliveries.

Ended runs are found by a scan, not hooked where they end (the worker, a cancel, the reconciler and a
pipeline's cascade all end runs): each pass takes finished runs not yet ``announced``, queues one delivery
per matching webhook of the run's project and marks the run announced, in one transaction. A run is
announced once even with several API processes (the flag is flipped with a guarded UPDATE).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api.errors import ApiError, NotFound
from api.models import FINISHED_STATUSES, Run, Webhook, WebhookDelivery, utcnow
from api.pagination import Keyset, Slice, paginate
from api.schemas import WebhookCreate
from api.services.runs import run_read
from api.webhook_signing import new_secret
from api.webhook_urls import Resolver, UrlPolicy, check_webhook_url, resolve
from rlrun.schemas import RunRead

MAX_WEBHOOKS_PER_PROJECT = 20
DELIVERIES_ORDER = Keyset(WebhookDelivery.created_at, WebhookDelivery.id, desc=True)  # newest first


class WebhookNotFound(NotFound):
    code = "webhook_not_found"


class TooManyWebhooks(ApiError):
    status = 409
    code = "too_many_webhooks"


def create_webhook(
    *,
    session: Session,
    project_id: uuid.UUID,
    body: WebhookCreate,
    policy: UrlPolicy,
    resolver: Resolver = resolve,
) -> Webhook:
    """Check the URL against the allow-list and store the webhook with a new signing secret."""
    check_webhook_url(body.url, policy, resolver)
    count = len(session.scalars(select(Webhook.id).where(Webhook.project_id == project_id)).all())
    if count >= MAX_WEBHOOKS_PER_PROJECT:
        raise TooManyWebhooks(f"a project has at most {MAX_WEBHOOKS_PER_PROJECT} webhooks; delete one first")
    webhook = Webhook(
        id=uuid.uuid4(),
        project_id=project_id,
        url=body.url,
        description=body.description,
        event_types=list(dict.fromkeys(body.event_types)),
        secret=new_secret(),
        created_at=utcnow(),
    )
    session.add(webhook)
    session.flush()
    return webhook


def get_webhook(*, session: Session, webhook_id: uuid.UUID, project_id: uuid.UUID) -> Webhook:
    webhook = session.get(Webhook, webhook_id)
    if webhook is None or webhook.project_id != project_id:
        raise WebhookNotFound(f"webhook {webhook_id} not found", field="webhook_id")
    return webhook


def list_webhooks(*, session: Session, project_id: uuid.UUID) -> Sequence[Webhook]:
    query = select(Webhook).where(Webhook.project_id == project_id).order_by(Webhook.created_at, Webhook.id)
    return session.scalars(query).all()


def delete_webhook(*, session: Session, webhook: Webhook) -> None:
    """Remove a webhook; its delivery log goes with it (ON DELETE CASCADE), pending deliveries too."""
    session.delete(webhook)


def list_deliveries(
    *, session: Session, webhook: Webhook, after: str | None, limit: int
) -> Slice[WebhookDelivery]:
    """The webhook's delivery log, newest first."""
    stmt = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook.id)
    return paginate(session, stmt, DELIVERIES_ORDER, limit=limit, cursor=after)


def event_body(run_read: RunRead, event_type: str) -> str:
    """The JSON every attempt sends: Standard Webhooks' ``{type, timestamp, data}`` with the run object."""
    payload: dict[str, Any] = {
        "type": event_type,
        "timestamp": (run_read.finished_at or utcnow()).isoformat(),
        "data": run_read.model_dump(mode="json"),
    }
    return json.dumps(payload, separators=(",", ":"))


def announce_ended_runs(session: Session, *, now: datetime | None = None, limit: int = 100) -> int:
    """Queue deliveries for runs that ended since the last pass; how many runs were announced."""
    now = now or utcnow()
    runs = session.scalars(
        select(Run)
        .where(Run.announced.is_(False), Run.finished_at.is_not(None))
        .order_by(Run.finished_at)
        .limit(limit)
    ).all()
    announced = 0
    for run in runs:
        claimed = session.execute(
            update(Run).where(Run.id == run.id, Run.announced.is_(False)).values(announced=True)
        )
        if claimed.rowcount != 1 or run.status not in FINISHED_STATUSES:  # type: ignore[attr-defined]
            continue
        announced += 1
        event_type = f"run.{run.status}"
        project_hooks = list_webhooks(session=session, project_id=run.project_id)
        hooks = [h for h in project_hooks if event_type in h.event_types]
        if not hooks:
            continue
        body = event_body(run_read(run), event_type)
        for hook in hooks:
            delivery_id = uuid.uuid4()
            session.add(
                WebhookDelivery(
                    id=delivery_id,
                    webhook_id=hook.id,
                    run_id=run.id,
                    event_type=event_type,
                    message_id=f"msg_{delivery_id.hex}",
                    body=body,
                    status="pending",
                    attempts=[],
                    next_attempt_at=now,
                    created_at=now,
                )
            )
    return announced


def retry_delay(failed_attempts: int, *, base: float, cap: float) -> float:
    """Seconds to wait after the n-th failed attempt: ``min(cap, base * 2**(n-1))`` (exponential)."""
    return float(min(cap, base * 2 ** max(failed_attempts - 1, 0)))


def record_attempt(
    delivery: WebhookDelivery,
    *,
    at: datetime,
    status_code: int | None,
    error: str | None,
    duration_ms: float,
    max_attempts: int,
    backoff: float,
    max_backoff: float,
) -> None:
    """Log one attempt; a 2xx ends the delivery succeeded, the last allowed failure ends it failed, any
    other failure schedules the next attempt with exponential backoff."""
    attempt = {
        "at": at.isoformat(),
        "status_code": status_code,
        "error": error,
        "duration_ms": round(duration_ms, 1),
    }
    delivery.attempts = [*delivery.attempts, attempt]  # a new list: JSON columns track assignment
    if error is None and status_code is not None and 200 <= status_code < 300:
        delivery.status, delivery.finished_at, delivery.next_attempt_at = "succeeded", at, None
    elif len(delivery.attempts) >= max_attempts:
        delivery.status, delivery.finished_at, delivery.next_attempt_at = "failed", at, None
    else:
        wait = retry_delay(len(delivery.attempts), base=backoff, cap=max_backoff)
        delivery.next_attempt_at = at + timedelta(seconds=wait)
