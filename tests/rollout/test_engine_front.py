"""``rlrun engine --remote``'s front (trainer/rollout/engine_front.py) before a stand-in engine that records
what reaches it: the token is checked, only a rollout's routes pass, uploads land in the front's own folder
(whole and checked, or refused with nothing loaded), and an adapter policy synced through it arrives as
peft saved it. The front before the real engine: tests/rollout/test_attached_engine.py."""

from __future__ import annotations

import io
import json
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rlrun.cli import main
from tests.factories import lora_policy, self_signed_certificate
from trainer.models import load_causal_lm, tiny_model_dir
from trainer.rollout.engine_front import EngineFront, check_safetensors
from trainer.rollout.engine_process import EngineError, EngineStartError
from trainer.rollout.served_engine import REQUIRED_OPTIONS, ServedEngine, attach_served_engine, folder_tar

TOKEN = "s3cret-token"


class StandIn:
    """An engine stand-in on loopback: every request's method, path and JSON body in ``calls``; at each
    ``/v1/load_lora_adapter`` the files in the named folder, read then (``loaded``); at each reload the
    ``model.safetensors`` found in the named folder (``reloaded``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.loaded: dict[str, dict[str, bytes]] = {}
        self.reloaded: list[bytes] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                stand_in.calls.append(("GET", self.path, self.headers.get("authorization")))
                if self.path.startswith("/server_info"):  # as `rlrun engine` starts an engine
                    self.answer(200, {"vllm_config": {"model_config": dict(REQUIRED_OPTIONS)}})
                    return
                self.answer(200, {"data": [{"id": "policy", "max_model_len": 64}]})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                stand_in.calls.append(("POST", self.path, body))
                if self.path == "/v1/load_lora_adapter":
                    folder = Path(body["lora_path"])
                    stand_in.loaded[body["lora_name"]] = {
                        p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()
                    }
                if self.path == "/collective_rpc":
                    folder = Path(body["kwargs"]["weights_path"])
                    stand_in.reloaded.append((folder / "model.safetensors").read_bytes())
                self.answer(200, {"ok": True})

            def log_message(self, *_: Any) -> None: ...

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.calls]

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join()


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[StandIn, EngineFront, Path]]:
    stand_in = StandIn()
    uploads = tmp_path / "front-uploads"
    uploads.mkdir()
    served = EngineFront(stand_in.url, TOKEN, uploads, host="127.0.0.1")
    try:
        yield stand_in, served, uploads
    finally:
        served.close()
        stand_in.close()


def url(served: EngineFront) -> str:
    return f"http://127.0.0.1:{served.port}"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_every_route_but_health_needs_the_token_and_the_engines_own_routes_stay_behind(
    front: tuple[StandIn, EngineFront, Path],
) -> None:
    stand_in, served, _ = front
    base = url(served)
    assert httpx.get(f"{base}/health").status_code == 200  # probes need no token
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": [[1]]}, headers=headers)
        assert refused.status_code == 401
        assert "RLRUN_ENGINE_TOKEN" in refused.json()["error"]["message"]
        assert httpx.put(f"{base}/rlrun/weights", content=b"x", headers=headers).status_code == 401
    assert stand_in.paths() == ["/health"]  # nothing refused reached the engine
    passed = httpx.post(f"{base}/v1/completions", json={"prompt": [[1, 2]]}, headers=AUTH)
    assert passed.status_code == 200 and passed.json() == {"ok": True}
    assert stand_in.calls[-1] == ("POST", "/v1/completions", {"prompt": [[1, 2]]})
    assert httpx.get(f"{base}/rlrun/front", headers=AUTH).json()["weights"] == "upload"
    # the engine's dev-mode routes are not reachable through the front, token or not
    for path in ("/collective_rpc", "/v1/load_lora_adapter", "/sleep"):
        assert httpx.post(f"{base}{path}", json={}, headers=AUTH).status_code in (404, 405), path
    assert "/collective_rpc" not in stand_in.paths()


def safetensors_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3)}, str(path))
    return path.read_bytes()


def test_a_weights_upload_is_reloaded_whole_and_a_cut_or_corrupt_one_is_refused_with_nothing_reloaded(
    front: tuple[StandIn, EngineFront, Path], tmp_path: Path
) -> None:
    stand_in, served, uploads = front
    base, whole = url(served), safetensors_bytes(tmp_path)
    cases = {
        "cut": (whole[:-5], "names 48 bytes of tensors; the upload has 43"),
        "not-json": (b"\x08\x00\x00\x00\x00\x00\x00\x00notjson!", "header is not JSON"),
        "empty": (b"", "0 bytes is no safetensors file"),
        "long-header": (b"\xff" * 8 + b"{}", "claims"),
    }
    for name, (body, message) in cases.items():
        resp = httpx.put(f"{base}/rlrun/weights", content=body, headers=AUTH)
        assert resp.status_code == 400, name
        assert message in resp.json()["error"]["message"], (name, resp.text)
    assert stand_in.reloaded == [] and not (uploads / "model.safetensors").exists()
    assert not list(uploads.iterdir())  # no partial file left
    resp = httpx.put(f"{base}/rlrun/weights", content=whole, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert stand_in.reloaded == [whole]  # the engine read the bytes sent, from the front's folder
    assert stand_in.calls[-1][2]["kwargs"] == {"weights_path": str(uploads)}


def test_an_upload_cut_off_by_the_client_leaves_nothing_and_the_next_one_goes_through(
    front: tuple[StandIn, EngineFront, Path], tmp_path: Path
) -> None:
    stand_in, served, uploads = front
    whole = safetensors_bytes(tmp_path)
    head = (
        f"PUT /rlrun/weights HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(whole)}\r\n\r\n"
    ).encode()
    partial = uploads / ".model.safetensors.partial"
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(head + whole[:20])
        deadline = time.monotonic() + 10
        while not partial.is_file():  # the front is taking the upload
            assert time.monotonic() < deadline, "the front wrote none of the upload"
            time.sleep(0.02)
    # the client went away mid-upload
    deadline = time.monotonic() + 10
    while list(uploads.iterdir()):
        assert time.monotonic() < deadline, list(uploads.iterdir())
        time.sleep(0.05)
    assert stand_in.reloaded == []
    assert httpx.put(f"{url(served)}/rlrun/weights", content=whole, headers=AUTH).status_code == 200
    assert stand_in.reloaded == [whole]


def test_check_safetensors_accepts_what_safetensors_writes(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes(tmp_path))
    check_safetensors(path)  # no error
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="names 48 bytes of tensors; the upload has 49"):
        check_safetensors(path)


def test_a_model_synced_through_the_front_reaches_the_engine_as_its_safetensors(
    front: tuple[StandIn, EngineFront, Path], tiny_cache: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load

    stand_in, served, _ = front
    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    client = ServedEngine(url(served), max_model_len=64, token=TOKEN, upload=True)
    try:
        client.sync_weights(model)
        assert not any(client.weights_dir.iterdir())  # streamed from the tensors, never written here
    finally:
        client.close()
    assert stand_in.paths()[-1] == "/reset_prefix_cache"
    received = load(stand_in.reloaded[-1])
    state = model.state_dict()
    assert received.keys() <= state.keys() and len(received) > 0
    for name, tensor in received.items():
        assert torch.equal(tensor, state[name]), name


def test_an_adapter_synced_through_the_front_is_loaded_from_the_front_as_peft_saved_it_and_unloaded_after(
    front: tuple[StandIn, EngineFront, Path], tiny_cache: Path, tmp_path: Path
) -> None:
    stand_in, served, uploads = front
    base, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    policy = lora_policy(base, seed=0, std=0.3)
    client = ServedEngine(url(served), max_model_len=64, token=TOKEN, upload=True, adapter_sync="lora")
    try:
        client.sync_weights(policy)
        first = client.model_name
        saved = tmp_path / "saved-first"
        policy.save_pretrained(str(saved))
        with torch.no_grad():  # a second version of the adapter
            next(p for n, p in policy.named_parameters() if "lora_B" in n).add_(1.0)
        client.sync_weights(policy)
        second = client.model_name
    finally:
        client.close()
    assert first != second
    assert set(stand_in.loaded) == {first, second}
    assert stand_in.loaded[first] == {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}
    assert (
        stand_in.loaded[first]["adapter_model.safetensors"]
        != stand_in.loaded[second]["adapter_model.safetensors"]
    )
    loads = [body for method, path, body in stand_in.calls if path == "/v1/load_lora_adapter"]
    assert [Path(b["lora_path"]).parent for b in loads] == [uploads / "adapters"] * 2  # the front's folder
    unloads = [body["lora_name"] for _, path, body in stand_in.calls if path == "/v1/unload_lora_adapter"]
    # the first when the second came; the second when the run closed (the engine outlives it)
    assert unloads == [first, second]
    assert list((uploads / "adapters").iterdir()) == []  # both folders removed by the front


def tar_of(members: dict[str, bytes]) -> bytes:
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w:") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return body.getvalue()


def test_an_adapter_upload_outside_its_folder_or_without_a_config_is_refused_and_nothing_is_loaded(
    front: tuple[StandIn, EngineFront, Path], tmp_path: Path
) -> None:
    stand_in, served, uploads = front
    base = url(served)
    cases = {
        "escape": (
            tar_of({"../../escaped.txt": b"x", "adapter_config.json": b"{}"}),
            "not a tar of an adapter",
        ),
        "no-config": (tar_of({"adapter_model.safetensors": b"x"}), "holds no adapter_config.json"),
        "not-tar": (b"plain bytes" * 100, "not a tar of an adapter"),
    }
    for name, (body, message) in cases.items():
        resp = httpx.put(f"{base}/rlrun/adapters/a-{name}", content=body, headers=AUTH)
        assert resp.status_code == 400, (name, resp.text)
        assert message in resp.json()["error"]["message"], (name, resp.text)
    for bad in ("bad name!", "..", ".hidden"):
        assert httpx.put(f"{base}/rlrun/adapters/{bad}", content=b"", headers=AUTH).status_code in (400, 404)
    assert httpx.put(f"{base}/rlrun/adapters/.x", content=b"", headers=AUTH).status_code == 400
    assert "/v1/load_lora_adapter" not in stand_in.paths()
    assert not (uploads.parent / "escaped.txt").exists() and not (tmp_path / "escaped.txt").exists()
    assert not (uploads / "adapters").exists() or not list((uploads / "adapters").iterdir())
    # the same name again, whole this time, loads; a third upload under it is refused while it is loaded
    good = tar_of({"adapter_config.json": b"{}", "adapter_model.safetensors": b"w"})
    assert httpx.put(f"{base}/rlrun/adapters/a-escape", content=good, headers=AUTH).status_code == 200
    again = httpx.put(f"{base}/rlrun/adapters/a-escape", content=good, headers=AUTH)
    assert again.status_code == 409 and "unload it first" in again.json()["error"]["message"]


def test_a_front_that_refuses_an_upload_fails_the_sync_with_its_message(
    front: tuple[StandIn, EngineFront, Path], tmp_path: Path
) -> None:
    _, served, _ = front
    client = ServedEngine(url(served), max_model_len=64, token="not-the-token", upload=True)
    try:
        with pytest.raises(EngineError, match="refused /rlrun/weights \\(401\\): .*RLRUN_ENGINE_TOKEN"):
            client.sync_weights(torch.nn.Linear(2, 2))
    finally:
        client.close()


def test_folder_tar_holds_the_folders_files_under_their_relative_names(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "sub" / "b.bin").write_bytes(b"\x00\x01")
    with tarfile.open(fileobj=io.BytesIO(folder_tar(tmp_path)), mode="r:") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert files == {"a.json": b"{}", "sub/b.bin": b"\x00\x01"}


def test_an_https_front_serves_workers_that_trust_its_certificate_and_no_one_in_plain_http(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed_certificate(tmp_path / "tls")
    other, _ = self_signed_certificate(tmp_path / "other")  # the same name, another key: not its issuer
    stand_in = StandIn()
    uploads = tmp_path / "front-uploads"
    uploads.mkdir()
    served = EngineFront(stand_in.url, TOKEN, uploads, host="127.0.0.1", tls=(cert, key))
    model, _ = load_causal_lm(str(tiny_model_dir("llama-0.4m", tiny_cache)))
    https, http = f"https://127.0.0.1:{served.port}", f"http://127.0.0.1:{served.port}"
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", TOKEN)
    try:
        assert served.scheme == "https"
        for trusted, given in ((None, "no RLRUN_ENGINE_CA"), (other, "the file in RLRUN_ENGINE_CA")):
            if trusted is None:
                monkeypatch.delenv("RLRUN_ENGINE_CA", raising=False)
            else:
                monkeypatch.setenv("RLRUN_ENGINE_CA", str(trusted))
            refused = (
                f"presented a certificate this worker does not trust \\({given}\\): "
                r"self[- ]signed certificate \(OpenSSL code 18\); "
                "set RLRUN_ENGINE_CA"
            )
            with pytest.raises(EngineStartError, match=refused):
                attach_served_engine(https, model, max_model_len=64)
        with pytest.raises(EngineStartError, match="no engine answers at RLRUN_ENGINE_URL=http://"):
            attach_served_engine(http, model, max_model_len=64)  # the front speaks https only
        assert stand_in.calls == []  # nothing reached the engine, the token never crossed in clear
        monkeypatch.setenv("RLRUN_ENGINE_CA", str(tmp_path / "missing.pem"))
        with pytest.raises(EngineStartError, match="RLRUN_ENGINE_CA=.*missing.pem is not a readable file"):
            attach_served_engine(https, model, max_model_len=64)
        monkeypatch.setenv("RLRUN_ENGINE_CA", str(cert))  # a self-signed front: its own certificate
        client = attach_served_engine(https, model, max_model_len=64)
        try:
            assert client.upload
            client.sync_weights(model)
        finally:
            client.close()
        assert stand_in.paths()[-1] == "/reset_prefix_cache"
        assert stand_in.reloaded and stand_in.paths()[0] == "/v1/models"  # after the refusals, the first
        served.close()
        assert served.app.state.engine.is_closed  # the front's client to the engine, closed with it
    finally:
        served.close()
        stand_in.close()


def test_a_front_given_a_key_that_is_not_its_certificates_refuses_to_start_naming_both(
    tmp_path: Path,
) -> None:
    cert, _ = self_signed_certificate(tmp_path / "a")
    _, key = self_signed_certificate(tmp_path / "b")
    with pytest.raises(
        ValueError,
        match="cert.pem and .*key.pem are not a PEM certificate and its unencrypted key: .*KEY_VALUES",
    ):
        EngineFront("http://127.0.0.1:9", TOKEN, tmp_path, host="127.0.0.1", tls=(cert, key))


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (
            ["--tls-cert", "c.pem", "--tls-key", "k.pem"],
            "--tls-cert and --tls-key are the front's: give them with --remote",
        ),
        (["--remote", "--tls-cert", "c.pem"], "give both --tls-cert and --tls-key"),
    ],
    ids=["without-remote", "without-key"],
)
def test_rlrun_engine_refuses_a_certificate_without_its_front_or_its_key(
    args: list[str], refusal: str, tiny_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tiny_model_dir("llama-0.4m", tiny_cache)
    assert main(["engine", "--model", str(folder), *args]) == 2  # before any engine starts
    assert refusal in capsys.readouterr().err


@pytest.mark.parametrize("trusted", ["issuer", "itself"])
def test_a_front_whose_certificate_a_ca_issued_is_trusted_through_the_ca_or_its_own_certificate(
    trusted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, ca_key = self_signed_certificate(tmp_path / "ca", host="10.9.8.7")
    cert, key = self_signed_certificate(tmp_path / "front", issuer=(ca, ca_key))
    stand_in = StandIn()
    served = EngineFront(stand_in.url, TOKEN, tmp_path, host="127.0.0.1", tls=(cert, key))
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", TOKEN)
    monkeypatch.setenv("RLRUN_ENGINE_CA", str(ca if trusted == "issuer" else cert))  # pinned: partial chain
    try:
        client = attach_served_engine(
            f"HTTPS://127.0.0.1:{served.port}", torch.nn.Linear(1, 1), max_model_len=64
        )
        client.close()
        assert client.upload
    finally:
        served.close()
        stand_in.close()


def test_a_certificate_for_another_host_is_refused_saying_the_url_is_not_among_its_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed_certificate(tmp_path / "tls", host="127.0.0.2")
    stand_in = StandIn()
    served = EngineFront(stand_in.url, TOKEN, tmp_path, host="127.0.0.1", tls=(cert, key))
    monkeypatch.setenv("RLRUN_ENGINE_TOKEN", TOKEN)
    monkeypatch.setenv("RLRUN_ENGINE_CA", str(cert))  # trusted, but not for this address
    try:
        with pytest.raises(
            EngineStartError, match="does not name the URL's host: .*subject alternative names"
        ):
            attach_served_engine(f"https://127.0.0.1:{served.port}", torch.nn.Linear(1, 1), max_model_len=64)
    finally:
        served.close()
        stand_in.close()
    assert stand_in.calls == []


def test_rlrun_engine_refuses_a_key_that_is_not_its_certificates_before_any_engine_starts(
    tiny_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography.hazmat.primitives import serialization

    cert, _ = self_signed_certificate(tmp_path / "a")
    _, key = self_signed_certificate(tmp_path / "b")
    folder = str(tiny_model_dir("llama-0.4m", tiny_cache))
    tls = ["--remote", "--host", "127.0.0.1", "--tls-cert", str(cert), "--tls-key"]
    assert main(["engine", "--model", folder, *tls, str(key)]) == 2
    assert "--tls-cert/--tls-key: " in capsys.readouterr().err
    encrypted = tmp_path / "encrypted.pem"  # its own key, under a password: nobody is there to type it
    own = serialization.load_pem_private_key((tmp_path / "a" / "key.pem").read_bytes(), password=None)
    encrypted.write_bytes(
        own.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    assert main(["engine", "--model", folder, *tls, str(encrypted)]) == 2
    assert "the key is encrypted" in capsys.readouterr().err
