"""/v1/webhooks: register URLs that hear about ended runs, and read their delivery log."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response

from api.deps import ProjectDep, SessionDep, SettingsDep
from api.models import Webhook, WebhookDelivery
from api.pagination import AfterCursor
from api.schemas import WebhookCreate
from api.services import webhooks as service
from api.webhook_urls import UrlPolicy
from rlrun.schemas import ErrorBody, Page, WebhookCreated, WebhookDeliveryRead, WebhookRead

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 409, 422)}
WebhookId = Annotated[uuid.UUID, Path()]


def _load(session: SessionDep, project_id: ProjectDep, webhook_id: WebhookId) -> Webhook:
    return service.get_webhook(session=session, webhook_id=webhook_id, project_id=project_id)


def _delivery_read(delivery: WebhookDelivery) -> WebhookDeliveryRead:
    return WebhookDeliveryRead.model_validate(
        {
            "id": delivery.id,
            "message_id": delivery.message_id,
            "run_id": delivery.run_id,
            "event_type": delivery.event_type,
            "status": delivery.status,
            "attempts": delivery.attempts,
            "next_attempt_at": delivery.next_attempt_at,
            "payload": json.loads(delivery.body),
            "created_at": delivery.created_at,
            "finished_at": delivery.finished_at,
        }
    )


@router.post("", status_code=201, response_model=WebhookCreated, responses=_ERRORS)
def create_webhook(
    body: WebhookCreate, session: SessionDep, settings: SettingsDep, project_id: ProjectDep
) -> WebhookCreated:
    """Register a URL. When a run of this project ends (succeeded, failed, cancelled) the server POSTs
    `{type, timestamp, data: <run>}` there, signed the Standard Webhooks way with the returned `secret`
    (shown only now), retrying failures with exponential backoff. URLs that resolve to non-public
    addresses are refused unless the server's allow-list admits them."""
    webhook = service.create_webhook(
        session=session, project_id=project_id, body=body, policy=UrlPolicy.from_settings(settings)
    )
    created = WebhookCreated.model_validate(
        {**WebhookRead.model_validate(webhook).model_dump(), "secret": webhook.secret}
    )
    session.commit()
    return created


@router.get("", response_model=list[WebhookRead])
def list_webhooks(session: SessionDep, project_id: ProjectDep) -> list[WebhookRead]:
    """This project's webhooks (secrets are not shown again)."""
    return [
        WebhookRead.model_validate(w) for w in service.list_webhooks(session=session, project_id=project_id)
    ]


@router.get("/{webhook_id}", response_model=WebhookRead, responses=_ERRORS)
def get_webhook(session: SessionDep, project_id: ProjectDep, webhook_id: WebhookId) -> WebhookRead:
    return WebhookRead.model_validate(_load(session, project_id, webhook_id))


@router.delete("/{webhook_id}", status_code=204, responses=_ERRORS)
def delete_webhook(session: SessionDep, project_id: ProjectDep, webhook_id: WebhookId) -> Response:
    """Remove a webhook and its delivery log; pending deliveries are dropped."""
    service.delete_webhook(session=session, webhook=_load(session, project_id, webhook_id))
    session.commit()
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", response_model=Page[WebhookDeliveryRead], responses=_ERRORS)
def list_deliveries(
    session: SessionDep,
    project_id: ProjectDep,
    webhook_id: WebhookId,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> Page[WebhookDeliveryRead]:
    """The delivery log, newest first: each message with its status and every attempt (HTTP status or
    error, duration)."""
    webhook = _load(session, project_id, webhook_id)
    found = service.list_deliveries(session=session, webhook=webhook, after=after, limit=limit)
    return found.as_page(_delivery_read)
