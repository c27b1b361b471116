"""Ended runs become signed POSTs: announce once, deliver, log every attempt, back off, give up.

Real database (SQLite and PostgreSQL), real HTTP to a receiver on loopback, the reference verifier.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook as ReferenceVerifier

from api.models import Project, Run, WebhookDelivery, utcnow
from api.schemas import WebhookCreate
from api.services.webhooks import announce_ended_runs, create_webhook, retry_delay
from api.settings import Settings
from api.webhook_dispatcher import deliver_due, dispatch_once
from api.webhook_urls import UrlPolicy
from tests.factories import make_dataset, make_run
from tests.webhooks.receiver import webhook_receiver

SETTINGS = Settings(webhook_allow_loopback=True, webhook_backoff_seconds=30, webhook_max_attempts=3)


def new_project(factory: sessionmaker[Session]) -> uuid.UUID:
    with factory.begin() as session:
        project = Project(id=uuid.uuid4(), name=f"wh-{uuid.uuid4().hex[:8]}", created_at=utcnow())
        session.add(project)
    return project.id


def add_webhook(
    factory: sessionmaker[Session], project_id: uuid.UUID, url: str, **body: object
) -> tuple[uuid.UUID, str]:
    with factory.begin() as session:
        hook = create_webhook(
            session=session,
            project_id=project_id,
            body=WebhookCreate(url=url, **body),  # type: ignore[arg-type]
            policy=UrlPolicy(allow_loopback=True),
        )
    return hook.id, hook.secret


def end_run(factory: sessionmaker[Session], project_id: uuid.UUID, status: str = "succeeded") -> uuid.UUID:
    with factory.begin() as session:
        dataset = make_dataset(session, project_id=project_id)
        run = make_run(session, dataset, project_id=project_id, status=status, finished_at=utcnow(), step=3)
    return run.id


def deliveries(factory: sessionmaker[Session], webhook_id: uuid.UUID) -> list[WebhookDelivery]:
    with factory() as session:
        return list(session.scalars(select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)))


def make_due(factory: sessionmaker[Session], webhook_id: uuid.UUID) -> None:
    with factory.begin() as session:
        for delivery in session.scalars(
            select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
        ):
            if delivery.status == "pending":
                delivery.next_attempt_at = utcnow() - timedelta(seconds=1)


def test_an_ended_run_is_posted_signed_with_the_run_object(committing_factory: sessionmaker[Session]) -> None:
    project = new_project(committing_factory)
    with webhook_receiver() as receiver:
        hook_id, secret = add_webhook(committing_factory, project, receiver.url)
        run_id = end_run(committing_factory, project)
        dispatch_once(committing_factory, SETTINGS)
        assert len(receiver.requests) == 1
        request = receiver.requests[0]
        payload = ReferenceVerifier(secret).verify(request.body, request.headers)
        assert payload["type"] == "run.succeeded"
        assert payload["data"]["id"] == str(run_id) and payload["data"]["status"] == "succeeded"
        assert payload["data"]["progress"] == {
            "step": 3,
            "total_steps": 3,
            "phase": None,
            "done": None,
            "total": None,
        }
        assert request.path == "/hooks/rlrun" and request.headers["content-type"] == "application/json"
        (delivery,) = deliveries(committing_factory, hook_id)
        assert delivery.status == "succeeded" and request.headers["webhook-id"] == delivery.message_id
        assert [a["status_code"] for a in delivery.attempts] == [200]
        # Announced once: later passes send nothing more.
        dispatch_once(committing_factory, SETTINGS)
        assert len(receiver.requests) == 1 and len(deliveries(committing_factory, hook_id)) == 1


def test_a_failed_attempt_is_retried_after_backoff_with_the_same_id(
    committing_factory: sessionmaker[Session],
) -> None:
    project = new_project(committing_factory)
    with webhook_receiver(statuses=[500]) as receiver:
        hook_id, secret = add_webhook(committing_factory, project, receiver.url)
        end_run(committing_factory, project, status="failed")
        before = utcnow()
        dispatch_once(committing_factory, SETTINGS)
        (delivery,) = deliveries(committing_factory, hook_id)
        assert delivery.status == "pending" and delivery.attempts[0]["status_code"] == 500
        assert "HTTP 500" in delivery.attempts[0]["error"]
        assert delivery.next_attempt_at is not None
        wait = (delivery.next_attempt_at - before).total_seconds()
        assert 30 <= wait < 35  # webhook_backoff_seconds after the first failure
        assert deliver_due(committing_factory, SETTINGS) == 0  # not due yet
        make_due(committing_factory, hook_id)
        assert deliver_due(committing_factory, SETTINGS) == 1
        (delivery,) = deliveries(committing_factory, hook_id)
        assert delivery.status == "succeeded" and [a["status_code"] for a in delivery.attempts] == [500, 200]
        first, second = receiver.requests
        assert first.headers["webhook-id"] == second.headers["webhook-id"] == delivery.message_id
        assert first.body == second.body
        assert ReferenceVerifier(secret).verify(second.body, second.headers)["type"] == "run.failed"


def test_delivery_gives_up_after_max_attempts(committing_factory: sessionmaker[Session]) -> None:
    project = new_project(committing_factory)
    with webhook_receiver(statuses=[503, 503, 503, 503]) as receiver:
        hook_id, _ = add_webhook(committing_factory, project, receiver.url)
        end_run(committing_factory, project, status="cancelled")
        dispatch_once(committing_factory, SETTINGS)
        for _ in range(4):
            make_due(committing_factory, hook_id)
            deliver_due(committing_factory, SETTINGS)
        (delivery,) = deliveries(committing_factory, hook_id)
        assert delivery.status == "failed" and len(delivery.attempts) == SETTINGS.webhook_max_attempts == 3
        assert delivery.next_attempt_at is None and delivery.finished_at is not None
        assert len(receiver.requests) == 3


def test_attempts_run_in_parallel(committing_factory: sessionmaker[Session]) -> None:
    """Both requests must be in flight at once to pass the receiver's barrier; one after the other, the
    first would wait there until the barrier breaks and be answered 500."""
    project = new_project(committing_factory)
    with webhook_receiver(barrier=threading.Barrier(2, timeout=5)) as receiver:
        first, _ = add_webhook(committing_factory, project, receiver.url)
        second, _ = add_webhook(committing_factory, project, receiver.url + "/2")
        end_run(committing_factory, project)
        dispatch_once(committing_factory, SETTINGS)
        for hook in (first, second):
            (delivery,) = deliveries(committing_factory, hook)
            assert delivery.status == "succeeded", delivery.attempts


def test_unreachable_receiver_is_logged_as_an_error(committing_factory: sessionmaker[Session]) -> None:
    project = new_project(committing_factory)
    with webhook_receiver() as receiver:
        url = receiver.url
    hook_id, _ = add_webhook(committing_factory, project, url)  # the receiver is gone now
    end_run(committing_factory, project)
    dispatch_once(committing_factory, SETTINGS)
    (delivery,) = deliveries(committing_factory, hook_id)
    assert delivery.status == "pending" and delivery.attempts[0]["status_code"] is None
    assert "ConnectError" in delivery.attempts[0]["error"]


def test_allow_list_is_checked_again_at_delivery(committing_factory: sessionmaker[Session]) -> None:
    project = new_project(committing_factory)
    with webhook_receiver() as receiver:
        hook_id, _ = add_webhook(committing_factory, project, receiver.url)
        end_run(committing_factory, project)
        dispatch_once(committing_factory, SETTINGS.model_copy(update={"webhook_allow_loopback": False}))
        assert receiver.requests == []
        (delivery,) = deliveries(committing_factory, hook_id)
        assert "refused by the allow-list" in delivery.attempts[0]["error"]


def test_event_types_filter_and_other_projects(committing_factory: sessionmaker[Session]) -> None:
    project, other = new_project(committing_factory), new_project(committing_factory)
    with webhook_receiver() as receiver:
        only_failed, _ = add_webhook(committing_factory, project, receiver.url, event_types=["run.failed"])
        end_run(committing_factory, project, status="succeeded")
        end_run(committing_factory, other, status="failed")
        failed = end_run(committing_factory, project, status="failed")
        dispatch_once(committing_factory, SETTINGS)
        assert [d.run_id for d in deliveries(committing_factory, only_failed)] == [failed]
        assert [json.loads(r.body)["data"]["id"] for r in receiver.requests] == [str(failed)]


def test_runs_that_have_not_ended_are_not_announced(committing_factory: sessionmaker[Session]) -> None:
    project = new_project(committing_factory)
    with committing_factory.begin() as session:
        dataset = make_dataset(session, project_id=project)
        running = make_run(session, dataset, project_id=project, status="running")
    with committing_factory.begin() as session:
        announce_ended_runs(session)
    with committing_factory() as session:
        assert session.get(Run, running.id).announced is False  # type: ignore[union-attr]


@pytest.mark.parametrize(("failures", "expected"), [(1, 5.0), (2, 10.0), (3, 20.0), (7, 320.0), (12, 3600.0)])
def test_retry_delay_doubles_up_to_the_cap(failures: int, expected: float) -> None:
    assert retry_delay(failures, base=5.0, cap=3600.0) == expected
