"""Plain functions that build rows and app clients for tests."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.deps import get_session, get_session_factory
from api.ingest import DatasetStatsBuilder
from api.main import create_app
from api.models import Dataset, DatasetRow, Run, utcnow
from api.settings import Settings
from trainer.ports import free_port


class FakeEnqueue:
    """Records the run ids the API would have sent to the broker; can be told to fail."""

    def __init__(self, fail: bool = False):
        self.sent: list[uuid.UUID] = []
        self.queues: list[str | None] = []
        self.fail = fail

    def __call__(self, run_id: uuid.UUID, queue: str | None = None) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append(run_id)
        self.queues.append(queue)


@contextmanager
def api_client(
    session: Session, settings: Settings | None = None, enqueue: Any = None
) -> Iterator[TestClient]:
    """A TestClient whose requests all use ``session`` (savepoint-isolated by the fixture)."""
    app = create_app(settings or Settings(), session_factory=None, enqueue=enqueue or FakeEnqueue())

    def _session() -> Iterator[Session]:
        yield session

    app.dependency_overrides[get_session] = _session
    app.dependency_overrides[get_session_factory] = lambda: lambda: nullcontext(session)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def pair_rows(n: int = 10) -> list[dict[str, str]]:
    return [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(n)]


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def make_dataset(session: Session, rows: list[dict[str, Any]] | None = None, **over: Any) -> Dataset:
    rows = rows if rows is not None else pair_rows()
    kind = over.pop("kind", "preference")
    stats = DatasetStatsBuilder(kind)
    try:
        for i, r in enumerate(rows):
            stats.add(r, "jsonl", f"{i:064x}")
    except (KeyError, TypeError, AttributeError):  # rows a test made malformed on purpose: counts only
        stats = DatasetStatsBuilder(kind, rows=len(rows))
    ds = Dataset(
        id=uuid.uuid4(),
        name=over.pop("name", "pairs"),
        kind=kind,
        row_count=len(rows),
        size_bytes=0,
        stats=stats.as_dict(),  # as an upload computes them, so the dataset reads back like any other
        **over,
    )
    session.add(ds)
    session.flush()
    for i, r in enumerate(rows):
        session.add(DatasetRow(dataset_id=ds.id, index=i, data=r, content_hash=f"{i:064d}"))
    session.flush()
    return ds


def dpo_spec(dataset_id: uuid.UUID, **hp: Any) -> dict[str, Any]:
    return {
        "algorithm": "dpo",
        "model": "tiny:llama-0.4m",
        "dataset_id": str(dataset_id),
        "hyperparameters": {"max_steps": 3, "batch_size": 4, "learning_rate": 1e-3, **hp},
    }


def make_run(session: Session, dataset: Dataset, **over: Any) -> Run:
    spec = over.pop("spec", None) or dpo_spec(dataset.id)
    fields: dict[str, Any] = {
        "id": uuid.uuid4(),
        "algorithm": "dpo",
        "status": "queued",
        "spec": spec,
        "dataset_id": dataset.id,
        "attempt": 0,
        "step": 0,
        "total_steps": spec["hyperparameters"]["max_steps"],
        "cancel_requested": False,
        "created_at": utcnow(),
    }
    run = Run(**(fields | over))
    session.add(run)
    session.flush()
    return run


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` under a real uvicorn server on a free loopback port, in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http="h11"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def lora_policy(
    base: Any, *, seed: int, std: float, params: str = "lora_B", targets: str | list[str] = "all-linear"
) -> Any:
    """``base`` under a rank-4 LoRA on ``targets`` (every linear layer), the adapter weights whose names
    hold ``params`` drawn from N(0, std) with ``seed`` (peft starts B at zero: an adapter that changes
    nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if params in name:
                param.normal_(0, std)
    return policy


def self_signed_certificate(
    folder: Any, host: str = "127.0.0.1", issuer: tuple[Any, Any] | None = None
) -> tuple[Any, Any]:
    """A certificate for ``host`` (an IP address, in its subject alternative names, as TLS clients check)
    and its key, written as PEM into ``folder``: ``(cert.pem, key.pem)`` paths. Self-signed and a CA of its
    own (a client trusts it given the certificate file, ``RLRUN_ENGINE_CA``), or with ``issuer`` (a CA's
    certificate and key files, as this returns them) signed by that CA and no CA itself."""
    import datetime
    import ipaddress
    from pathlib import Path

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    issuer_name, signer = name, key
    if issuer is not None:
        issuer_name = x509.load_pem_x509_certificate(Path(issuer[0]).read_bytes()).subject
        signer = serialization.load_pem_private_key(Path(issuer[1]).read_bytes(), password=None)  # type: ignore[assignment]
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .sign(signer, hashes.SHA256())
    )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path
