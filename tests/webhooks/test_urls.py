"""The SSRF guard: which webhook URLs the server agrees to call, and what an attempt connects to."""

from __future__ import annotations

import ipaddress
import uuid

import httpcore
import pytest

from api.settings import Settings
from api.webhook_dispatcher import CheckedBackend, ClaimedDelivery, Outcome, attempt_delivery, http_sender
from api.webhook_urls import UrlPolicy, WebhookUrlRefused, check_webhook_url, pinned_target, reached_ipv4
from tests.webhooks.receiver import webhook_receiver

DNS = {
    "hooks.example.com": ["93.184.216.34"],
    "metadata.example.com": ["169.254.169.254"],
    "intranet.example.com": ["10.1.2.3"],
    "mixed.example.com": ["93.184.216.34", "192.168.1.10"],
    "v6.example.com": ["2606:2800:220:1:248:1893:25c8:1946"],
    "mapped.example.com": ["::ffff:127.0.0.1"],
    "cgnat.example.com": ["100.64.0.7"],
    "nat64.example.com": ["2606:2800:220:1:248:1893:25c8:1946", "64:ff9b::a9fe:a9fe"],
}


def fake_resolver(host: str, _port: int) -> list[str]:
    if host not in DNS:
        raise OSError("Name or service not known")
    return DNS[host]


DEFAULT = UrlPolicy()


def refusal(url: str, policy: UrlPolicy = DEFAULT) -> str | None:
    try:
        check_webhook_url(url, policy, fake_resolver)
    except WebhookUrlRefused as exc:
        assert exc.field == "url" and exc.status == 422
        return exc.message
    return None


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/x",
        "http://hooks.example.com:8080/x?y=1",
        "https://v6.example.com/",
        "https://93.184.216.34/",
    ],
)
def test_public_urls_pass(url: str) -> None:
    assert refusal(url) is None


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://hooks.example.com/x", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("https:///nohost", "names no host"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("https://hooks.example.com:99999/", "not a valid URL"),
        ("https://nowhere.example.com/", "cannot resolve"),
        ("http://127.0.0.1:8000/v1/runs", "loopback"),
        ("http://[::1]/", "loopback"),
        ("http://mapped.example.com/", "loopback"),
        ("http://metadata.example.com/latest/meta-data", "169.254.169.254 is not a public address"),
        ("http://169.254.169.254/", "not a public address"),
        ("http://intranet.example.com/", "10.1.2.3 is not a public address"),
        ("http://mixed.example.com/", "192.168.1.10 is not a public address"),
        ("http://cgnat.example.com/", "not a public address"),
        ("http://0.0.0.0:8000/", "not a public address"),
        ("http://224.0.0.1/", "not a public address"),
    ],
)
def test_internal_and_malformed_urls_are_refused(url: str, reason: str) -> None:
    message = refusal(url)
    assert message is not None and reason in message, message


def test_loopback_and_private_networks_only_when_configured() -> None:
    loopback = UrlPolicy(allow_loopback=True)
    assert refusal("http://127.0.0.1:9/", loopback) is None
    assert refusal("http://mapped.example.com/", loopback) is None
    assert refusal("http://intranet.example.com/", loopback) is not None  # loopback only, not 10/8
    private = UrlPolicy(allowed_networks=(ipaddress.ip_network("10.1.0.0/16"),))
    assert refusal("http://intranet.example.com/", private) is None
    assert refusal("http://127.0.0.1/", private) is not None
    assert refusal("http://mixed.example.com/", private) is not None  # 192.168/16 is still outside


def test_host_allow_list() -> None:
    policy = UrlPolicy(allowed_hosts=("hooks.example.com", "*.partner.example"))
    assert refusal("https://hooks.example.com/", policy) is None
    assert "allow-list" in (refusal("https://v6.example.com/", policy) or "")
    DNS["ci.partner.example"] = ["93.184.216.35"]
    assert refusal("https://ci.partner.example/", policy) is None
    assert "allow-list" in (refusal("https://partner.example.evil.com/", policy) or "")


def test_settings_build_the_policy_and_refuse_bad_networks() -> None:
    policy = UrlPolicy.from_settings(
        Settings(webhook_allowed_hosts=["Hooks.Example.com."], webhook_allowed_networks=["10.0.0.0/8"])
    )
    assert policy.allowed_hosts == ("hooks.example.com",) and not policy.allow_loopback
    assert policy.allowed_networks == (ipaddress.ip_network("10.0.0.0/8"),)
    with pytest.raises(ValueError, match="not-a-net"):
        Settings(webhook_allowed_networks=["not-a-net"])


def test_the_real_resolver_sees_localhost_as_loopback() -> None:
    with pytest.raises(WebhookUrlRefused, match="loopback"):
        check_webhook_url("http://localhost:8000/", UrlPolicy())
    assert check_webhook_url("http://localhost:8000/", UrlPolicy(allow_loopback=True)) in ("127.0.0.1", "::1")


def test_attempts_connect_to_the_checked_address() -> None:
    target = pinned_target("https://hooks.example.com:8443/a/b?c=1", "93.184.216.34")
    assert target.url == "https://93.184.216.34:8443/a/b?c=1"
    assert target.host_header == "hooks.example.com:8443" and target.server_name == "hooks.example.com"
    v6 = pinned_target("http://v6.example.com/x", "2606:2800:220:1:248:1893:25c8:1946")
    assert v6.url == "http://[2606:2800:220:1:248:1893:25c8:1946]/x" and v6.host_header == "v6.example.com"


@pytest.mark.parametrize(
    ("url", "reaches"),
    [
        ("http://[::ffff:7f00:1]/", "127.0.0.1"),  # IPv4-mapped
        ("http://[::7f00:1]/", "127.0.0.1"),  # IPv4-compatible
        ("http://[::127.0.0.1]/", "127.0.0.1"),  # the same, dotted
        ("http://[::ffff:0:7f00:1]/", "127.0.0.1"),  # IPv4-translated (SIIT)
        ("http://[::ffff:0:a01:203]/", "10.1.2.3"),
        ("http://[64:ff9b::a9fe:a9fe]/", "169.254.169.254"),  # NAT64, well-known prefix
        ("http://[64:ff9b::10.1.2.3]/", "10.1.2.3"),
        ("http://[2002:a9fe:a9fe::1]/", "169.254.169.254"),  # 6to4
        ("http://[2002:c0a8:10a::1]/", "192.168.1.10"),
        ("http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/", "192.0.2.45"),  # Teredo client (de-obfuscated)
        ("http://nat64.example.com/", "169.254.169.254"),  # from DNS, next to a public address
    ],
)
def test_ipv6_forms_of_internal_ipv4_addresses_are_refused(url: str, reaches: str) -> None:
    message = refusal(url)
    assert message is not None and f"reaches {reaches}: " in message, message
    if reaches != "127.0.0.1":  # allowing loopback allows nothing else
        assert refusal(url, UrlPolicy(allow_loopback=True)) is not None


@pytest.mark.parametrize(
    "url",
    [
        "http://[64:ff9b:1::a9fe:a9fe]/",  # a site's own NAT64 (RFC 8215)
        "http://[fec0::1]/",  # site-local
        "http://[2001:0:5db8:d822::a247:27dc]/",  # Teredo, public server and client: 2001::/32 is not
        "http://[::]/",
    ],
)
def test_non_public_ipv6_ranges_are_refused(url: str) -> None:
    assert "is not a public address" in (refusal(url) or "")


@pytest.mark.parametrize(
    "url",
    [
        "https://[::ffff:93.184.216.34]/",
        "https://[::ffff:0:5db8:d822]/",
        "https://[64:ff9b::93.184.216.34]/",
        "https://[2002:5db8:d822::1]/",
    ],
)
def test_ipv6_forms_of_public_ipv4_addresses_pass(url: str) -> None:
    assert refusal(url) is None


def test_embedded_ipv4_is_matched_against_the_ipv4_allow_list() -> None:
    private = UrlPolicy(allowed_networks=(ipaddress.ip_network("10.1.0.0/16"),))
    assert refusal("http://[64:ff9b::10.1.2.3]/", private) is None
    assert refusal("http://[::ffff:10.1.2.3]/", private) is None
    assert refusal("http://[64:ff9b::10.2.0.1]/", private) is not None
    assert refusal("http://[::7f00:1]/", UrlPolicy(allow_loopback=True)) is None


def test_reached_ipv4_of_each_form() -> None:
    def reached(address: str) -> list[str]:
        return [str(v4) for v4 in reached_ipv4(ipaddress.IPv6Address(address))]

    assert reached("::ffff:7f00:1") == ["127.0.0.1"]
    assert reached("::7f00:1") == ["127.0.0.1"]
    assert reached("::ffff:0:7f00:1") == ["127.0.0.1"]
    assert reached("64:ff9b::a9fe:a9fe") == ["169.254.169.254"]
    assert reached("2002:a9fe:a9fe::1") == ["169.254.169.254"]
    assert reached("2001:0:4136:e378:8000:63bf:3fff:fdd2") == ["65.54.227.120", "192.0.2.45"]
    assert reached("::1") == [] and reached("::") == [] and reached("2606:2800:220:1::1") == []


def test_the_real_resolver_normalises_numeric_ipv4_forms() -> None:
    for host in ("2130706433", "0x7f.1", "127.1", "0177.0.0.1"):
        with pytest.raises(WebhookUrlRefused, match="loopback"):
            check_webhook_url(f"http://{host}:8000/", UrlPolicy())


def claimed(url: str) -> ClaimedDelivery:
    return ClaimedDelivery(uuid.uuid4(), url, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_1", "{}")


def test_an_attempt_checks_dns_once_and_connects_to_the_address_it_checked() -> None:
    answers = iter([["93.184.216.34"], ["127.0.0.1"]])  # the name is rebound right after the check
    asked: list[str] = []

    def rebinding(host: str, _port: int) -> list[str]:
        asked.append(host)
        return next(answers)

    sent: list[tuple[str, str, str]] = []

    def record(url: str, _body: str, headers: dict[str, str], server_name: str) -> Outcome:
        sent.append((url, headers["host"], server_name))
        return Outcome(200, None, 1.0)

    claim = claimed("https://hooks.example.com/in?x=1")
    assert attempt_delivery(claim, UrlPolicy(), rebinding, record).status_code == 200
    assert asked == ["hooks.example.com"]  # one answer, used for both the check and the connection
    assert sent == [("https://93.184.216.34/in?x=1", "hooks.example.com", "hooks.example.com")]
    again = attempt_delivery(claim, UrlPolicy(), rebinding, record)  # the next attempt checks again
    assert "refused by the allow-list" in (again.error or "") and len(sent) == 1


def test_the_connection_itself_refuses_addresses_outside_the_allow_list() -> None:
    with webhook_receiver() as receiver:
        port = receiver.url.split(":")[2].split("/")[0]
        allowed = http_sender(5, UrlPolicy(allow_loopback=True))
        assert allowed(receiver.url, "{}", {}, "127.0.0.1").status_code == 200
        refused = http_sender(5, UrlPolicy())
        for url, why in [
            (receiver.url, "loopback"),  # a URL that skipped the check
            (f"http://[::ffff:127.0.0.1]:{port}/", "loopback"),  # normalised at connect time too
            (f"http://localhost:{port}/", "not a checked address"),  # a name, not the pinned address
        ]:
            outcome = refused(url, "{}", {}, "x")
            assert outcome.status_code is None and "refused at connect" in (outcome.error or ""), outcome
            assert why in (outcome.error or "")
        assert "not a checked address" in (allowed(f"http://localhost:{port}/", "{}", {}, "x").error or "")
        assert len(receiver.requests) == 1  # only the allowed one arrived


def test_the_peer_of_the_opened_socket_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []

    class Socket:
        def getpeername(self) -> tuple[str, int]:
            return ("127.0.0.1", 443)  # connected elsewhere than asked (a proxy, a NAT, a bug)

    class Stream:
        def get_extra_info(self, _info: str) -> Socket:
            return Socket()

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", lambda *_args, **_kw: Stream())
    with pytest.raises(httpcore.ConnectError, match="127.0.0.1: loopback"):
        CheckedBackend(UrlPolicy()).connect_tcp("93.184.216.34", 443)
    assert closed == [True]
